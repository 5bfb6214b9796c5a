"""The recorder under other loops than Lightning: the Hugging Face Trainer, a plain loop."""
