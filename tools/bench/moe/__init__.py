"""The mixture-of-experts benchmark: ZeRO-2, ZeRO-3 and ZeRO-2 + EP2 on the same work."""
