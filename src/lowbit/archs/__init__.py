"""Declarative maps of model families (lowbit.archs.decoders: dense decoder layers), the layer
between recipes and algorithms: every algorithm that folds or re-wires reads them."""
