"""The data benchmark: preparation throughput, time to first step and packing utilisation."""
