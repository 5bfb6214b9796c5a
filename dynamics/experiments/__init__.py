"""The experiments ``dynamics run`` trains (see ``registry``), with their modules and data."""

from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule

__all__ = ["TeacherStudentData", "TeacherStudentModule"]
