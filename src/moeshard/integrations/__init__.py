"""Where users already are: moeshard models driven by other libraries' training loops.

* :mod:`moeshard.integrations.transformers`: the transformers ``Trainer`` and TRL's trainers
  (``SFTTrainer``, ...) save, resume and reload a moeshard model through moeshard
  (:class:`~moeshard.integrations.transformers.MoeshardTrainerMixin`,
  :func:`~moeshard.integrations.transformers.moeshard_trainer`).

Nothing under ``moeshard.ops`` / ``models`` / ``io`` imports this package; it imports them.
"""
