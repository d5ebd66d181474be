"""stranger30: docs/scale_out.md followed as a stranger would."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError


def test_serve_ray_build_refuses_a_model_that_is_no_text() -> None:
    """docs/scale_out.md's builder (``serve run asyncinfer.serve_ray:build``, a config file's ``args``) checks its
    arguments before deploying, but ``embedding_model: 5`` in the YAML raised a bare ``AttributeError: 'int' object
    has no attribute 'partition'``, naming nothing."""
    serve_ray = pytest.importorskip("asyncinfer.serve_ray")
    for key in ("model", "embedding_model", "name"):
        with pytest.raises(InvalidParameterError, match=f"^{key}=5 is invalid"):
            serve_ray.build({"model": "/models/llama", key: 5})
    with pytest.raises(InvalidParameterError, match=r"embedding_model=\['a'\] is invalid: allowed a model path"):
        serve_ray.build({"model": "/models/llama", "embedding_model": ["a"]})
