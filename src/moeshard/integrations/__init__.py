"""Where users already are: moeshard models built in one call and driven by other libraries'
training loops.

* :mod:`moeshard.integrations.pretrained`: :func:`moeshard.from_pretrained`, config -> meta model
  -> placement -> mesh -> parallelize -> load (-> verify) in one collective call.
* :mod:`moeshard.integrations.transformers`: the transformers ``Trainer`` and TRL's trainers
  (``SFTTrainer``, ...) save, resume and reload a moeshard model through moeshard
  (:class:`~moeshard.integrations.transformers.MoeshardTrainerMixin`,
  :func:`~moeshard.integrations.transformers.moeshard_trainer`).

Nothing under ``moeshard.ops`` / ``models`` / ``io`` imports this package; it imports them.
"""
