"""Adapters that plug tilegen's ops into other libraries; each imports its library only when asked to."""
