"""Compatibility name for :mod:`kvdiag.bundle` (the bundle writer and loader)."""

from kvdiag.bundle import BUNDLE_FILE, atomic_write_text, load_bundle, resolve_bundle_dir, save_bundle

__all__ = ["BUNDLE_FILE", "atomic_write_text", "load_bundle", "resolve_bundle_dir", "save_bundle"]
