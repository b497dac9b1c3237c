"""GQA / MHA -> hybrid sliding-window + linear attention (LoLCATs, Zhang et al. 2024), whose cache does not
grow with the context.

Per layer the source's projections stay; softmax attention is kept over the last ``window`` keys, and every
older key is reached through learned Hedgehog feature maps (Zhang et al. ICLR 2024), phi(q) . phi(k) in place
of exp(q . k / sqrt(d)), so their keys and values fold into a state of 2F x (d + 2) values per KV head. The
feature maps are fitted layer by layer to the softmax attention's output on calibration windows ("attention
transfer"), then ``heal`` can train the whole attention. The package: ``transfer`` (the fit) and ``method``
(settings, plan, the operation and its report); the runtime is ``HybridLinearAttention`` in
``modeling/modeling_attnsurg.py``; ``settings`` holds the options alone, light to import. The method and its
planner proxy register themselves when ``attnsurg.methods`` imports every module of the package.
"""
