-- kfs-worker migration 0007: what the platform's 0007_knowledge_node_generations adds to the
-- compilation attempts of 0006. (Its knowledge_nodes column, index and CHECK are part of the
-- knowledge_nodes table in 0001.)
--
-- An attempt that reached projection_built or a later checkpoint always carries its candidate
-- publication. The platform adds the CHECK unguarded; here it is added only when no constraint of
-- that name exists, so adopting a platform database changes nothing.
DO $kfs_0007_candidate_checkpoint$
BEGIN
  IF NOT EXISTS (
    SELECT 1
    FROM "pg_constraint"
    WHERE "conrelid" = 'document_compilation_attempts'::regclass
      AND "conname" = 'document_compilation_attempts_candidate_checkpoint_ck'
  ) THEN
    ALTER TABLE "document_compilation_attempts"
      ADD CONSTRAINT "document_compilation_attempts_candidate_checkpoint_ck"
      CHECK (
        "checkpoint" NOT IN ('projection_built', 'smoke_eval_passed', 'published')
        OR ("candidate_publication_id" IS NOT NULL AND "candidate_fingerprint" IS NOT NULL)
      );
  END IF;
END
$kfs_0007_candidate_checkpoint$;
