"""Memory arithmetic in one tested place: model states and buffers by ZeRO stage (states), activations
traced through the real model code (activations), and the estimate that combines them (estimate)."""

from .activations import Activations, activation_bytes  # noqa: F401
from .compute import training_compute  # noqa: F401
from .estimate import (  # noqa: F401
    Estimate,
    Launch,
    Precomputed,
    estimate,
    fit_verdict,
    parse_memory,
    rank_total,
)
from .run_estimate import for_run  # noqa: F401
from .shape import ModelShape  # noqa: F401
