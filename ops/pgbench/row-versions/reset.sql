TRUNCATE kfs_probe_effects;
UPDATE kfs_probe_jobs SET checkpoint='queued', run_state='queued', active_slot=1, execution_attempts=0, worker_id=NULL,
  lease_token=NULL, lease_expires_at=NULL, heartbeat_at=NULL, row_version=2, started_at=NULL, completed_at=NULL, updated_at=now();
UPDATE kfs_probe_outbox SET status='dispatched', available_at=now()+interval '1 hour', delivered_at=NULL, updated_at=now();
DROP TABLE IF EXISTS rv_batches;
CREATE TABLE rv_batches AS
  SELECT (row_number() over ()) AS no, ids, oids, dids, toks, false AS taken FROM (
    SELECT array_agg(j.id ORDER BY j.id) ids, array_agg(o.id ORDER BY j.id) oids, array_agg(o.queue_job_id ORDER BY j.id) dids,
           array_agg(gen_random_uuid() ORDER BY j.id) toks
    FROM (SELECT id, (row_number() over (order by random())-1)/16 AS b FROM kfs_probe_jobs) j
    JOIN kfs_probe_outbox o ON o.probe_job_id = j.id GROUP BY j.b) x;
ALTER TABLE rv_batches ADD PRIMARY KEY (no);
VACUUM (ANALYZE) kfs_probe_jobs;
VACUUM (ANALYZE) kfs_probe_outbox;
VACUUM (ANALYZE) kfs_probe_effects;
VACUUM (ANALYZE) rv_batches;
CHECKPOINT;
