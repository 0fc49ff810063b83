"""One-shot commands around `lztasks` for the Celery end-to-end test.

    python lzctl.py declare             # the task queue and <queue>.dlq
    python lzctl.py send TASK_ID ORDER AMOUNT
    python lzctl.py result TASK_ID TIMEOUT_S   # prints {"state", "result"}
    python lzctl.py delete              # both queues (cleanup)

Each prints one JSON line on success and exits non-zero with the reason
on stderr otherwise.
"""

import json
import sys

from lztasks import app, charge, dead_letter_queue, task_queue


def declare():
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=5)
        channel = conn.default_channel
        dead_letter_queue.bind(channel).declare()
        task_queue.bind(channel).declare()
    return {"declared": [task_queue.name, dead_letter_queue.name]}


def send(task_id, order_id, amount):
    r = charge.apply_async(args=(order_id, int(amount)), task_id=task_id)
    return {"sent": r.id}


def result(task_id, timeout):
    r = app.AsyncResult(task_id)
    try:
        value = r.get(timeout=float(timeout), propagate=False)
    except Exception as e:  # noqa: BLE001 - report whatever it was
        return {"state": r.state, "error": f"{type(e).__name__}: {e}"}
    if r.state != "SUCCESS":
        return {"state": r.state, "error": repr(value), "traceback": r.traceback}
    return {"state": r.state, "result": value}


def delete():
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for q in (task_queue, dead_letter_queue):
            q.bind(channel).delete()
        task_queue.exchange.bind(channel).delete()
    return {"deleted": [task_queue.name, dead_letter_queue.name]}


def main(argv):
    commands = {"declare": declare, "send": send, "result": result, "delete": delete}
    if not argv or argv[0] not in commands:
        sys.exit(__doc__)
    print(json.dumps(commands[argv[0]](*argv[1:])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
