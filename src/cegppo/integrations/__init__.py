"""Adapters that run the CE-GPPO objectives inside external RL frameworks.

- :mod:`cegppo.integrations.verl`: registers the ``ce_gppo`` and ``gppo`` policy losses in verl 0.9.x
  (loaded automatically at ``import verl`` through the ``verl.plugins`` entry point).
- :mod:`cegppo.integrations.trl`: ``CEGPPOConfig`` / ``CEGPPOTrainer``, subclasses of TRL 1.16's GRPO ones.

Importing this package imports neither framework; each submodule imports its own.
"""
