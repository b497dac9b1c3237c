"""GQA / MHA -> DeepSeek-style multi-head latent attention (MLA), written as a stock DeepseekV3 checkpoint.

The package: ``settings`` (the step's settings and calibration, light to import), ``plan`` (how a budget is
spent), ``engines`` (what each engine takes), ``fit`` (the closed form, steps 1-5 below), ``assemble`` (the
DeepseekV3 model), ``refine`` (step 6), ``conversion`` (a model in memory), ``stream`` (one layer in memory at a
time), ``report``, ``method`` (the registered method) and ``proxy`` (its error proxy for ``analyze plan``).
Importing the package imports none of them.

Per layer, with H query heads, G KV heads, head dim d, RoPE pairs (i, i + d/2) rotating at theta^(-2i/d):

1. RoRoPE (TransMLA, Meng et al. 2025, sec. 4): for each frequency i the G key 2-vectors can be mixed by an
   orthogonal G x G matrix U_i without breaking RoPE, since the rotation acts the same on each of them;
   with q'_{h,j,i} = U_i[j, g(h)] q_{h,i} every head's score is unchanged. U_i is the PCA of the keys at
   that frequency (calibration statistics), so component j = 0 carries most of the positional energy.
2. RoPE budget: DeepseekV3 has one RoPE key shared by all heads, of width R. Standard layout: component 0 of
   the R/2 highest frequencies keeps RoPE (rope_theta becomes theta^(R/d), so DeepseekV3's R/2 pairs rotate
   at exactly those frequencies). Where R/2 is at most half the d/2 frequencies, TransMLA's
   FreqFold: f = (d/2) / (R/2) consecutive frequencies form a group whose f G key 2-vectors RoRoPE mixes as one, as
   if all rotated at the group's highest frequency (rope_theta theta^(f R/d)); component 0 of each group keeps
   RoPE, so the kept pairs span the spectrum. Flexible layout (opt-in): further components of each frequency too, up to
   all G (exact at full budget), expressed with longrope per-pair factors. Every other component moves,
   unrotated, to the no-RoPE key.
3. Latent: the no-RoPE key and the values are compressed jointly into a rank-r latent by PCA of their
   calibration second moment, optionally weighted by what consumes them (the query second moment for keys,
   W_o^T W_o per head group for values, each block rescaled to its unweighted energy), computed in float64.
4. Latent norm: DeepseekV3 always applies an RMSNorm to the latent, c / rms(c) * w, which would rescale each
   token's keys (no-RoPE part) and values by a factor of its own (on the demo model the attention sink's
   latent is 3-8 times smaller than other tokens' from the middle layers on). One extra latent channel far
   larger than the latent and (nearly) the same for every token makes the RMS (nearly) constant, and the
   norm weight undoes it, so the latent passes through. Two output formats:
   - exact (transformers only): the channel is a constant bias C >> |latent| (RMS C / sqrt(r + 1) up to a
     relative |c|^2 / 2C^2).
   - native (default; no biases anywhere, as the DeepSeek graphs of llama.cpp, vLLM and SGLang have none):
     the channel is S a . x, with a the direction whose projection of the normalised input is closest to 1
     over the calibration tokens (the sink weighted apart). Its spread around 1 (2-6% off the calibration
     domain on the demo model, against 7-16% for the latent's own size) is the format's error; the source's
     biases fold through it the same way (b ~ b (a . x)), and refinement trains the whole layer, norm and
     channel included, with the norm in place.
5. The softmax scale of DeepseekV3 is (qk_nope + R)^-1/2: the ratio to the original d^-1/2 is folded into q.
   In the exact format, query biases (Qwen2) have no place in DeepseekV3's plain q_proj, so such models route
   q through q_a -> q_a_layernorm -> q_b: q_a is the identity plus one constant channel (the same norm trick),
   which the norm turns into exactly 1, and q_b's column for it is the bias.
6. Refinement (optional, from the closed form; in the native format from whichever of its constant-channel
   dominances, CHANNEL_DOMINANCES, and constant-direction ridges, CONSTANT_RIDGES, scores lowest on the
   converted model's own stream): layer by layer, Adam on q_proj, kv_a and kv_b minimizes the
   relative squared error between the converted layer's residual-stream update and what brings the converted
   model's stream back to the original's (layer-wise reconstruction as in BRECQ, Li et al. 2021, carried
   sequentially as in GPTQ). Each token's error is measured relative to the norm of the original stream at
   that token: the next layer reads the stream through an RMSNorm, and without it the first token of every
   window (an attention sink whose residual grows ~10^4 times the others' from the middle layers on) holds
   over 90% of the squared error. In the exact format the norm channels stay frozen. The learning rate is
   constant, or decays on a cosine, which long refinements need.
"""
