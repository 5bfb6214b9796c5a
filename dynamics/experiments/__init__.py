"""The experiments ``dynamics run`` trains (see ``registry``), with their modules and data."""

from dynamics.experiments.teacher_student import TeacherStudentData, TeacherStudentModule

__all__ = ["TeacherStudentData", "TeacherStudentModule"]
