"""Extra passes over the module that never perturb training: the loss rule, isolation (forked
RNG, saved buffers and train/eval flags, ``.grad`` untouched), the initial gradient and the
split of a step's loss change."""
