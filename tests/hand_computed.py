"""What the hand-computed float64 tests of the objective share: exact tensors and a tight comparison."""
import math

import torch

D = torch.float64
L = math.log


def t(values):
    return torch.tensor(values, dtype=D)


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D),
                               rtol=tol, atol=tol)
