"""Parallel axes beyond ZeRO: the mesh, the axis interface, tensor, sequence, pipeline, expert; which combine."""
