"""The processes a run is: the launcher (launch.py, over torchrun's elastic agent), the agent's
restarts and rendezvous (agent.py), and the watchdog that ends a rank stuck in a collective (watchdog.py).
"""
