"""LightningModules and data for the experiments the toolkit ships."""

from dynamics.experiments.teacher_student import TeacherStudentData, TeacherStudentModule

__all__ = ["TeacherStudentData", "TeacherStudentModule"]
