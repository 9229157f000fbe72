"""The bench's peer: a Celery 5 worker doing the bare loop's work, the way Celery users do it.

Each task runs one UPDATE of its row and commits it; the message is acked after the task
returns (acks_late) and each worker process takes one message at a time (prefetch multiplier 1).
Settings come from the environment the bench sets: KFS_PEER_BROKER (the AMQP URL),
KFS_PEER_DSN (the Postgres URL) and KFS_PEER_QUEUE (the queue the bench published to).
"""

import os

import psycopg
from celery import Celery

app = Celery("bench_peer", broker=os.environ["KFS_PEER_BROKER"])
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ["KFS_PEER_QUEUE"],
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_conn = None


def _connection():
    """One connection per worker process, opened on its first task."""
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(os.environ["KFS_PEER_DSN"], autocommit=False)
    return _conn


@app.task(name="bench_peer.touch")
def touch(row_id):
    conn = _connection()
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE bench_peer SET hits = hits + 1, done_at = clock_timestamp() WHERE id = %s",
            (row_id,),
        )
    conn.commit()
