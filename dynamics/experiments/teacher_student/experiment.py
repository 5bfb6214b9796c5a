"""The teacher–student comparison as the ``dynamics run`` experiment ``teacher_student``.

Every student is built from the config's seed, so all share θ0; they differ only in the
activation shift their variant names. The first two students' initial gradients span a plane
that every run file records coordinates on from step 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynamics.callbacks import (
    GradientPlane,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.errors import DynamicsError
from dynamics.experiments.experiment import Built, Recording
from dynamics.experiments.shift_experiment import ShiftExperiment, hessian_probes
from dynamics.experiments.teacher_student.config import TeacherStudentConfig
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule
from dynamics.geometry.plane import Plane, plane_from_gradients
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import parameter_vector
from dynamics.passes.initial_gradient import initial_gradient
from dynamics.store import names


class TeacherStudent(ShiftExperiment[TeacherStudentConfig]):
    """Students regressing one teacher, one per activation shift in ``config.variants``.

    Example::

        experiment, config = load_config("teacher_student", steps=200)
        run_experiment(experiment, config, "runs/demo")  # runs/demo/{unshifted,shifted}.h5
    """

    name = "teacher_student"
    config_class = TeacherStudentConfig

    def module(self, config: TeacherStudentConfig, shift: str | float) -> TeacherStudentModule:
        return TeacherStudentModule(
            **vars(config.model),
            shift=shift,
            seed=config.seed,
            **config.optimizer.module_kwargs(),
        )

    def data(self, config: TeacherStudentConfig) -> TeacherStudentData:
        return TeacherStudentData(
            **vars(config.model),
            shift=config.data.teacher_shift,
            teacher_seed=config.data.teacher_seed,
            data_seed=config.data.data_seed,
            batch_size=config.data.batch_size,
            heldout_size=config.data.heldout_size,
        )

    def recordings(
        self, config: TeacherStudentConfig, built: Mapping[str, Built]
    ) -> dict[str, Recording]:
        first = next(iter(built.values()))
        probe_batch = next(iter(first.data.train_dataloader()))
        plane = _initial_gradient_plane(built, probe_batch)
        record = config.record
        every = record.every_n_steps
        recordings = {}
        for variant in built:
            probes = [
                TrainingLoss(every),
                HiddenStateNorms(every_n_steps=every),
                ParameterDisplacement(every, snapshot_budget_mb=record.snapshot_budget_mb),
                LoggedMetrics([names.VAL_LOSS]),
                GradientPlane(basis=plane, batch=probe_batch, every_n_steps=every),
            ]
            probes += hessian_probes(
                record.hessian_top_k, record.hessian_every_n_steps, probe_batch
            )
            recordings[variant] = Recording(probes, record.flush_interval_s)
        return recordings


def _initial_gradient_plane(built: Mapping[str, Built], probe_batch: Any) -> Plane | None:
    """The plane of the first two students' initial gradients, before either trains.

    Computed up front so that both run files carry the same plane, and (a, b, r), from step 0.

    Raises:
        DynamicsError: the two gradients span no plane (e.g. both variants have one shift).
    """
    if len(built) < 2:
        return None
    pair = list(built)[:2]
    students = [built[name].module for name in pair]
    layout = ParameterLayout.of(students[0])
    theta0 = parameter_vector(students[0], layout).double().numpy()
    try:
        gradients = [initial_gradient(s, probe_batch, layout).double().numpy() for s in students]
        return plane_from_gradients(theta0, *gradients)
    # Zero or collinear gradients: a config that varies nothing; not finite: a shift so large
    # that the loss overflows.
    except (ValueError, FloatingPointError) as error:
        raise DynamicsError(f"variants {pair[0]} and {pair[1]}: {error}") from None
