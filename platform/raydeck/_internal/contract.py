"""Names that two layers agree on without importing each other: environment variables a job is
started with, Ray KV keys, actor names and MLflow tags.

Why here: each name has a writer in one layer and a reader in another (the queue sets
``RAYDECK_QUEUE_JOB``, the job's tracker reads it; a job's driver tags its run with the job
digest, the queue's history reads the tag). Kept in the lowest layer, neither side imports the
other for a string, and a change to a name is one edit that both sides see. Only names: no code,
no defaults a user sets (those are settings, :mod:`raydeck.config`).
"""

from __future__ import annotations

# Ray's internal KV namespace raydeck writes to (a preempted rank's word to its driver, Serve's
# own bounds the queue keeps while it lowers them).
KV_NAMESPACE = "raydeck"

# The queue's detached actor, in the settings' Ray namespace.
QUEUE_ACTOR_NAME = "raydeck-queue"
# The queue's id of a job it started, in that job's runtime env.
QUEUE_JOB_ENV = "RAYDECK_QUEUE_JOB"
# The current attempt's token, which the job sends with each call to the queue (its checkpoints,
# its stop, its completion), so only that attempt reports them. Issued by the queue per attempt;
# not a secret from whoever can read the job's runtime env (anyone with Ray access). Secret-named
# on purpose: redaction hides it and a job never forwards it to a job it submits.
QUEUE_TOKEN_ENV = "RAYDECK_QUEUE_TOKEN"
# An elastic job's allowed size: the queue restarts it at another through this same signal.
QUEUE_WORKERS_ENV = "RAYDECK_QUEUE_WORKERS"
# A preempted job's exit status (EX_TEMPFAIL: try again later), so it is not mistaken for done.
PREEMPTED_EXIT_CODE = 75
# On the run of a preempted job: how many times, and where each stopped.
PREEMPTIONS_TAG = "raydeck.preemptions"
PREEMPTION_TAG_PREFIX = "raydeck.preemption."

# "The same job" across submissions (a digest, not a credential: no KEY/TOKEN in the names, which
# redaction would hide): the job's driver tags its MLflow run with it, and the queue predicts
# durations from earlier runs with that tag.
JOB_DIGEST_ENV = "RAYDECK_JOB_DIGEST"
JOB_DIGEST_TAG = "raydeck.job_digest"

# What a Ray job is to raydeck, in its job-config metadata: ``raydeck submit`` and the queue
# submit "job"s, the preflight probe is a "probe", and a command's driver (``raydeck status``,
# ``queue``, ``jobs``...: raydeck.cluster.connection.connect_existing) a "command", which
# ``raydeck jobs`` never lists (raydeck.jobs.submission.list_jobs).
JOB_KIND_METADATA = "raydeck_kind"
COMMAND_DRIVER_KIND = "command"
