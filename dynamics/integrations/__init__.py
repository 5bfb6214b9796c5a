"""The recorder under loops other than Lightning: the Hugging Face Trainer, accelerate and
plain PyTorch loops."""
