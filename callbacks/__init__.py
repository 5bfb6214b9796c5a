"""Lightning glue: the recorder callback and its probes."""
