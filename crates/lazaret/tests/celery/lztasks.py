"""The Celery app of lazaret's Celery end-to-end test (`tests/it/celery.rs`).

A task queue on RabbitMQ declared as a quorum queue whose broker-enforced
delivery limit dead-letters a task that keeps killing its worker into
`<queue>.dlq`, which a lazaret watch source takes in. Results go to Redis.

Environment (all set by the test):

- ``LZ_CELERY_BROKER_URL``: ``amqp://guest:guest@127.0.0.1:5672/%2f``
- ``LZ_CELERY_RESULT_URL``: ``redis://127.0.0.1:6379/15``
- ``LZ_CELERY_QUEUE``: the task queue, unique per test run
- ``LZ_CELERY_CRASH_FILE``: while this file exists, ``charge`` kills its
  own process (a segfault, an OOM kill: nothing Celery can catch)
- ``LZ_CELERY_DELIVERY_LIMIT``: the quorum queue's ``x-delivery-limit`` (2)
"""

import os
import signal

from celery import Celery
from kombu import Exchange, Queue

QUEUE = os.environ["LZ_CELERY_QUEUE"]
DEAD_LETTER_QUEUE = QUEUE + ".dlq"
DELIVERY_LIMIT = int(os.environ.get("LZ_CELERY_DELIVERY_LIMIT", "2"))

# The task queue: quorum, so that RabbitMQ counts deliveries
# (`x-delivery-count`) and dead-letters a message returned more than
# `x-delivery-limit` times (RabbitMQ 3.10: with a limit of 2 the task runs
# three times), with reason `delivery_limit`, through the default exchange
# to `<queue>.dlq`. (A topic exchange, not direct: Celery
# 5.5 warns that its native delayed delivery cannot use a direct one.)
QUEUE_EXPIRES_MS = 15 * 60 * 1000

task_queue = Queue(
    QUEUE,
    Exchange(QUEUE, type="topic", durable=True),
    routing_key=QUEUE,
    durable=True,
    queue_arguments={
        "x-queue-type": "quorum",
        "x-delivery-limit": DELIVERY_LIMIT,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": DEAD_LETTER_QUEUE,
        # RabbitMQ deletes it by itself after 15 minutes unused, should the
        # test die before `lzctl.py delete` runs (the broker outlives runs).
        "x-expires": QUEUE_EXPIRES_MS,
    },
)

# Where RabbitMQ puts them: a plain durable classic queue. Declared before
# anything is sent (`lzctl.py declare`): a dead-lettered message routed to
# a queue that does not exist yet is dropped.
dead_letter_queue = Queue(
    DEAD_LETTER_QUEUE,
    exchange=None,
    routing_key=DEAD_LETTER_QUEUE,
    durable=True,
    queue_arguments={"x-expires": QUEUE_EXPIRES_MS},
)

app = Celery("lztasks")
app.conf.update(
    broker_url=os.environ["LZ_CELERY_BROKER_URL"],
    result_backend=os.environ["LZ_CELERY_RESULT_URL"],
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_queues=[task_queue],
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    # Acknowledge after the task ran, and hand a task whose worker process
    # died back to the broker (requeue) instead of acknowledging it: each
    # such return counts a delivery on the quorum queue.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # Quorum queues refuse global QoS; Celery 5.5 turns it off when it sees
    # one among task_queues (this is the default, said out loud).
    worker_detect_quorum_queues=True,
    # Seeing a quorum queue, Celery 5.5 also declares its native
    # delayed-delivery topology (28 queues `celery_delayed_*`); classic
    # ones are far lighter for the broker than 28 Raft groups.
    broker_native_delayed_delivery_queue_type="classic",
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    worker_hijack_root_logger=False,
)


@app.task(name="lztasks.charge")
def charge(order_id, amount):
    """Charges an order; dies hard while the crash file exists."""
    crash = os.environ.get("LZ_CELERY_CRASH_FILE")
    if crash and os.path.exists(crash):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"order_id": order_id, "charged": amount, "status": "charged"}
