"""Building a model family's module on the meta device: shapes only, no memory, no random init."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from asyncinfer.models.config import ModelConfig
from asyncinfer.models.layers import EAGER_OPS, ElementwiseOps
from asyncinfer.models.registry import model_family


class _SkipInit(TorchFunctionMode):
    """Skip the random initialisation of meta tensors (their values do not exist anyway).

    ``normal_`` on the meta device imports ``torch._dynamo``, ~4 s on a 2-core CPU
    (and ~5 s more under load), for numbers nobody reads. A function mode is
    thread-local: nothing else in the process is affected.
    """

    _INITS = frozenset({
        torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_,
        nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
    })

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._INITS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                return tensor
        return func(*args, **kwargs)


def build_on_meta(config: ModelConfig, ops: ElementwiseOps = EAGER_OPS) -> nn.Module:
    """The family's model for ``config`` on the meta device (for loading into, or for counting),
    built with the element-wise functions ``ops``.

    Raises:
        ModelLoadError: the config's architecture is not registered.
    """
    with torch.device("meta"), _SkipInit():
        return model_family(config.architecture).model_class(config, ops)
