"""The model as partita reads it: captured as an FX graph with its loss (capture.py, its checks, the
memo of captures, fake ops), that graph as networkx (graph.py), the input specs, the losses and the ops' facts.
"""
