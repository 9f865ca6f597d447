"""Dense FFNs and the expert blocks built from them, shared by the module view (conversion), the graph pass
(passes/moeize.py), the streaming engines and calibration: what a found FFN is (match.py), how a block is built
from it (build.py), the neuron k-means of a split (kmeans.py) and the layer selection (layers.py)."""
