"""The phases of a switch (the ReMP transaction), as the controller reports them and the router times them."""

# The phases that run while the router serves: the target's shards built beside the steps, then the KV pre-copied in
# rounds, then the start of the freeze until a request first waits for it (the steps in flight run on and deliver
# their tokens); every other phase runs frozen, and their sum is the downtime (the cutover).
STAGING_PHASE = "STAGING"
PRECOPY_PHASE = "PRECOPY"
DRAINING_PHASE = "DRAINING"
SERVING_PHASES = (STAGING_PHASE, PRECOPY_PHASE, DRAINING_PHASE)
PREPARING_PHASES = (STAGING_PHASE, PRECOPY_PHASE)  # the staging time: built and copied ahead of the freeze

# Every phase in the order a switch runs them.
PHASES = (STAGING_PHASE, PRECOPY_PHASE, DRAINING_PHASE, "QUIESCING", "PREPARING_WORKERS", "APPLYING_TOPOLOGY",
          "MIGRATING", "REBINDING")

# The duty a switch's staging and KV pre-copy run at unless the operator says otherwise (reconfig up --staging-duty;
# the controller sends it to the workers with each switch, services.worker.pacing paces with it):
# bench/cutover.py, SmolLM2 on 2 cores, 10 to 200 live requests: TPOT while staging +5% on average and +24% at
# worst at 0.5, against +14% and +42% unpaced; staging ~2x longer at 16 requests, up to 6x at 200.
DEFAULT_STAGING_DUTY = 0.5
