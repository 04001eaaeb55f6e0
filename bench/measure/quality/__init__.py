"""Model quality beside kernel speed ([R4 2/6]): an implementation swapped into a language model's attention
(`swap`), the model scored on a task with the swapped and the reference attention on the same samples
(`evaluate`), and the statistics of the difference (`metrics`); `model_step` runs them for a model case."""
