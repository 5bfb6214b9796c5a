"""The recorder, its probes, and the Lightning callbacks.

``DynamicsRecorder`` here is a ``pytorch_lightning`` callback; ``lightning.pytorch`` users take
``dynamics.callbacks.lightning.DynamicsRecorder``. Probes work under either, and under the other
loops' adapters (:mod:`dynamics.integrations`): each hook receives a :class:`Fit`.
"""

from dynamics.callbacks.activation_bias import ActivationBias
from dynamics.callbacks.bias_audit import BiasAudit
from dynamics.callbacks.bias_component import BiasComponent
from dynamics.callbacks.check import check_probe
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.gradient_plane import GradientPlane
from dynamics.callbacks.gradient_stats import GradientStats
from dynamics.callbacks.hessian_blocks import BlockHessian
from dynamics.callbacks.hessian_density import HessianDensity
from dynamics.callbacks.hessian_eigenspace_overlap import EigenspaceOverlap
from dynamics.callbacks.hessian_gradient_share import GradientShare
from dynamics.callbacks.hessian_measurement import HessianMeasurement
from dynamics.callbacks.hessian_spectrum import HessianSpectrum
from dynamics.callbacks.hessian_trace import HessianTrace
from dynamics.callbacks.hessian_vectors import EigenvectorSnapshots
from dynamics.callbacks.hidden_state_norms import HiddenStateNorms
from dynamics.callbacks.init_biases import InitBiases
from dynamics.callbacks.logged_metrics import LoggedMetrics
from dynamics.callbacks.loss_change_split import LossChangeSplit
from dynamics.callbacks.parameter_displacement import ParameterDisplacement
from dynamics.callbacks.probe import Probe, ProbeUnavailable, SeriesSpec
from dynamics.callbacks.recorder import DynamicsRecorder
from dynamics.callbacks.shift_activations import ShiftActivations
from dynamics.callbacks.training_loss import TrainingLoss
from dynamics.callbacks.trajectory_geometry import TrajectoryGeometry
from dynamics.callbacks.unit_health import UnitHealth

__all__ = [
    "ActivationBias",
    "BiasAudit",
    "BiasComponent",
    "BlockHessian",
    "DynamicsRecorder",
    "EigenspaceOverlap",
    "EigenvectorSnapshots",
    "Fit",
    "GradientPlane",
    "GradientShare",
    "GradientStats",
    "HessianDensity",
    "HessianMeasurement",
    "HessianSpectrum",
    "HessianTrace",
    "HiddenStateNorms",
    "InitBiases",
    "LoggedMetrics",
    "LossChangeSplit",
    "ParameterDisplacement",
    "Probe",
    "ProbeUnavailable",
    "SeriesSpec",
    "ShiftActivations",
    "TrainingLoss",
    "TrajectoryGeometry",
    "UnitHealth",
    "check_probe",
]
