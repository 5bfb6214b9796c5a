"""The autoencoder experiment's model: a small VGG-style convolutional autoencoder."""

from __future__ import annotations

from torch import nn

#: How the convolutions are initialized: ``"kaiming"``, He et al.'s forward-preserving init
#: (Kaiming normal, fan-in, ReLU gain; zero biases), under which the pre-activations on the
#: digits have standard deviations of 0.3–0.8 at θ0, of the order the expected shift
#: c = E[ReLU(z)], z ~ N(0, 1) assumes; ``"pytorch"``: PyTorch's default (Kaiming uniform with
#: a = √5), whose pre-activations here have standard deviations of 0.01–0.35, so the shift far
#: exceeds their ReLU's mean and the shifted hidden states start near the constant −c.
INITS = ("kaiming", "pytorch")


def conv_autoencoder(width: int, init: str = "kaiming") -> nn.Sequential:
    """Two VGG stages down (8×8 → 4×4, ``width`` then ``2·width`` channels), two up.

    Every convolution is 3×3 with padding 1 and followed by a ReLU, except the last, which
    outputs the image. The ReLUs (the hidden states the paper splits) are ``encoder.1``,
    ``encoder.3``, ``encoder.6``, ``encoder.8``, ``decoder.2``, ``decoder.4``.

    Example::

        net = conv_autoencoder(width=16)
        net(torch.rand(4, 1, 8, 8)).shape  # (4, 1, 8, 8)
    """
    w = width
    net = nn.Sequential(
        nn.Sequential(  # encoder
            nn.Conv2d(1, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            nn.ReLU(),
        ),
        nn.Sequential(  # decoder
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(2 * w, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, 1, 3, padding=1),
        ),
    )
    if init == "kaiming":
        for conv in net.modules():
            if isinstance(conv, nn.Conv2d):
                nn.init.kaiming_normal_(conv.weight, mode="fan_in", nonlinearity="relu")
                nn.init.zeros_(conv.bias)
    return net
