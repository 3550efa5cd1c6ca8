"""The Hugging Face hub, asked once whether it can be reached, and what a dry run plans with when it cannot.

Without the question, every file a dry run would fetch costs huggingface_hub's five retries with backoff
(26 s measured here, where the hub's name does not resolve) before failing. A dry run needs the architecture
only, so offline it plans with what stands in for the hub's config.json. A real run always loads its model
with from_pretrained(id): nothing here is used for training.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

from zero_recipes.config import shipped
from zero_recipes.config.train_config import TrainConfig, parse_model_config
from zero_recipes.errors import ConfigError
from zero_recipes.modeling import model as modeling

PROBE_TIMEOUT_S = 2.0
"""One HEAD of the hub's endpoint: it fails in 0.1 s where the name does not resolve and in 1 ms where the port
is closed (measured); a working link answers well within 2 s."""


def unreachable() -> Optional[str]:
    """Why the hub cannot be reached, or None when it can: huggingface_hub's offline mode (HF_HUB_OFFLINE or
    TRANSFORMERS_OFFLINE), else one HEAD request to its endpoint (HF_ENDPOINT) through huggingface_hub's own
    HTTP session (its proxies and certificates) that fails or gets no answer within PROBE_TIMEOUT_S."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return _probe(constants.ENDPOINT)


@lru_cache(maxsize=None)
def _probe(endpoint: str) -> Optional[str]:
    from huggingface_hub.utils import get_session

    try:
        answer = get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # DNS, connect, TLS and timeout errors alike (httpx's classes): no hub to ask
        return f"no answer from {endpoint}: {type(e).__name__}"
    if answer.status_code >= 500:
        return f"{endpoint} answers HTTP {answer.status_code}"
    return None


EMBEDDED_OUTPUTS = {Path(TrainConfig.output_dir): "the quick start", Path("outputs/tiny-sft"): "recipes/tiny-sft.yaml"}
"""Where the tiny recipes leave the embedded tiny Llama, trained: what a recipe that starts from them plans with
before they ran."""


def dry_run_model_config(cfg: TrainConfig):
    """(model config, notes): the config a dry run plans with, and a note whenever it is not the one training
    would load. Where training would fetch the config and cannot, what stands in is, in order: the local cache;
    the model's published config.json shipped in recipes/configs/ (shipped.ARCHITECTURES); for the quick
    start's output before the quick start ran, the embedded tiny Llama it will hold."""
    name = cfg.model_name_or_path
    overrides = parse_model_config(cfg.model_config) or {}
    notes = ()
    # lora_options.validate_options lets LoRA with --model_config through for a dry run only
    if name and cfg.lora_r > 0 and cfg.model_config is not None:
        notes = (
            f"--model_config stands in for the architecture of {name} in this dry run only: LoRA trains on the "
            "base's own weights, so launch it without --model_config",
        )
    if not name or "model_type" in overrides or Path(os.path.expanduser(name)).exists():
        return modeling.load_model_config(cfg), notes  # nothing to fetch
    if (writer := EMBEDDED_OUTPUTS.get(Path(name))) is not None:
        embedded = modeling.load_model_config(dataclasses.replace(cfg, model_name_or_path=None))
        return embedded, notes + (
            f"{name} does not exist yet ({writer} writes it): planned with the embedded tiny Llama it will hold",
        )
    modeling.local_missing(name)  # a path that does not exist is refused as training refuses it
    why = unreachable()
    if why is None:
        return modeling.load_model_config(cfg), notes
    try:
        cached = modeling.load_model_config(cfg, local_files_only=True)
        return cached, notes + (f"hub offline ({why}): the config of {name} read from the local cache",)
    except ConfigError:
        pass
    stand_in = shipped.architecture_file(name)
    if stand_in is None:
        raise ConfigError(
            f"cannot read the config of {name}: {why}, and it is not in the local cache. Reach the hub, or give "
            "its config.json (with model_type) as --model_config for the dry run"
        )
    fields = {**json.loads(stand_in.read_text()), **overrides}
    config = modeling.load_model_config(dataclasses.replace(cfg, model_config=fields))
    return config, notes + (
        f"hub offline ({why}): planned with the published architecture of {name}, {shipped.ARCHITECTURES[name]}; "
        "training loads its config and weights from the hub",
    )
