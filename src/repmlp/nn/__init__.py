"""The paper's Section 3 and nothing else: the RepMLP block, its layers and its re-parameterization.

- :mod:`.reparam`: the pure, differentiable maths (fold a BN, a conv as an FC, FC3's merged kernel);
- :mod:`.layers`: ``ConvBN`` and the groupwise FC; :mod:`.block`: the 2-D and 1-D blocks, their
  perceptrons and partitions;
- :mod:`.convert`: whole-model conversion; :mod:`.checks`: input-shape checks that trace.

Imports only :mod:`repmlp.errors` and :mod:`repmlp.numerics` (the full-float32 guard of every check) of the
package: every other folder builds on this one.
"""
