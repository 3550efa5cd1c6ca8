"""The model: building it, mixtures of experts, per-example attention on packed rows, the tiled loss."""
