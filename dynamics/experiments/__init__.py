"""The experiments ``dynamics run`` trains: one folder each (model, module, data, config,
experiment), found by name through :mod:`~dynamics.experiments.registry`.

The controlled experiment's student and data are exported here, as LightningCLI configs name
them (``dynamics.experiments.TeacherStudentModule``).
"""

from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule

__all__ = ["TeacherStudentData", "TeacherStudentModule"]
