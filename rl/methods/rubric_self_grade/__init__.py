"""Rubric self-grading: a frozen grader scores research plans against rubric items. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "reward": ["rl.methods.rubric_self_grade.reward"],
    "task": ["rl.methods.rubric_self_grade.task"],
}
