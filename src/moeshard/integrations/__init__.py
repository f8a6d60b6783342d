"""Where users already are: one-call loading (:func:`moeshard.from_pretrained`), and the
transformers / TRL / accelerate / torchtitan glue. These modules compose models/ and ops/;
nothing below imports them."""
