"""The autopilot: measured layout profiles, a pure switching policy, SLO intents, an arrival forecast, and the loop
that feeds the policy and calls the same Reconfigure path an operator uses."""

MODES = ("off", "advise", "auto")  # what it does with a decision: nothing, report it (advise), or switch
