-- kfs-worker migration 0019: the platform's 0019_profile_publication_bindings.
-- A compilation attempt may now pin the exact embedding and retrieval profile revisions it was built
-- with (eight nullable columns: attempts written by older writers, the worker's included, keep them
-- NULL), and a new ledger binds each publication to the profile revisions it was built from.
-- The platform's file also asks for a unique index knowledge_space_profile_revisions_attempt_fk_uq;
-- the constraint of that name from 0018 already provides it, so nothing is done for it here.

-- The platform's migration ledger. On a database the platform built it exists already; on a fresh
-- one it is otherwise created only by 0099, which runs after this file. Same definition as 0099's.
CREATE TABLE IF NOT EXISTS "schema_migrations" (
  "migration_id" VARCHAR(255) PRIMARY KEY,
  "dialect" VARCHAR(32) NOT NULL,
  "applied_at" TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP
);

ALTER TABLE "document_compilation_attempts"
  ADD COLUMN IF NOT EXISTS "embedding_profile_kind" VARCHAR(16),
  ADD COLUMN IF NOT EXISTS "embedding_profile_revision_id" UUID,
  ADD COLUMN IF NOT EXISTS "embedding_profile_revision" INTEGER,
  ADD COLUMN IF NOT EXISTS "embedding_profile_snapshot_digest" CHAR(64),
  ADD COLUMN IF NOT EXISTS "retrieval_profile_kind" VARCHAR(16),
  ADD COLUMN IF NOT EXISTS "retrieval_profile_revision_id" UUID,
  ADD COLUMN IF NOT EXISTS "retrieval_profile_revision" INTEGER,
  ADD COLUMN IF NOT EXISTS "retrieval_profile_snapshot_digest" CHAR(64);

-- Each quadruple is all NULL or complete; an embedding profile is only recorded together with a
-- retrieval profile. The fixed kind columns let the foreign keys tell the two kinds apart.
ALTER TABLE "document_compilation_attempts"
  DROP CONSTRAINT IF EXISTS "document_compilation_attempts_embedding_profile_ck",
  DROP CONSTRAINT IF EXISTS "document_compilation_attempts_retrieval_profile_ck",
  DROP CONSTRAINT IF EXISTS "document_compilation_attempts_profile_tuple_ck",
  DROP CONSTRAINT IF EXISTS "document_compilation_attempts_embedding_profile_fk",
  DROP CONSTRAINT IF EXISTS "document_compilation_attempts_retrieval_profile_fk";
ALTER TABLE "document_compilation_attempts"
  ADD CONSTRAINT "document_compilation_attempts_embedding_profile_ck" CHECK (
    (
      "embedding_profile_kind" IS NULL AND "embedding_profile_revision_id" IS NULL
      AND "embedding_profile_revision" IS NULL AND "embedding_profile_snapshot_digest" IS NULL
    )
    OR (
      "embedding_profile_kind" = 'embedding' AND "embedding_profile_revision_id" IS NOT NULL
      AND "embedding_profile_revision" >= 1 AND "embedding_profile_snapshot_digest" IS NOT NULL
    )
  ),
  ADD CONSTRAINT "document_compilation_attempts_retrieval_profile_ck" CHECK (
    (
      "retrieval_profile_kind" IS NULL AND "retrieval_profile_revision_id" IS NULL
      AND "retrieval_profile_revision" IS NULL AND "retrieval_profile_snapshot_digest" IS NULL
    )
    OR (
      "retrieval_profile_kind" = 'retrieval' AND "retrieval_profile_revision_id" IS NOT NULL
      AND "retrieval_profile_revision" >= 1 AND "retrieval_profile_snapshot_digest" IS NOT NULL
    )
  ),
  ADD CONSTRAINT "document_compilation_attempts_profile_tuple_ck" CHECK (
    (
      "embedding_profile_kind" IS NULL AND "embedding_profile_revision_id" IS NULL
      AND "embedding_profile_revision" IS NULL AND "embedding_profile_snapshot_digest" IS NULL
      AND "retrieval_profile_kind" IS NULL AND "retrieval_profile_revision_id" IS NULL
      AND "retrieval_profile_revision" IS NULL AND "retrieval_profile_snapshot_digest" IS NULL
    )
    OR (
      "retrieval_profile_kind" = 'retrieval' AND "retrieval_profile_revision_id" IS NOT NULL
      AND "retrieval_profile_revision" >= 1 AND "retrieval_profile_snapshot_digest" IS NOT NULL
      AND (
        (
          "embedding_profile_kind" IS NULL AND "embedding_profile_revision_id" IS NULL
          AND "embedding_profile_revision" IS NULL AND "embedding_profile_snapshot_digest" IS NULL
        )
        OR (
          "embedding_profile_kind" = 'embedding' AND "embedding_profile_revision_id" IS NOT NULL
          AND "embedding_profile_revision" >= 1 AND "embedding_profile_snapshot_digest" IS NOT NULL
        )
      )
    )
  ),
  ADD CONSTRAINT "document_compilation_attempts_embedding_profile_fk"
    FOREIGN KEY (
      "tenant_id", "knowledge_space_id", "embedding_profile_kind",
      "embedding_profile_revision_id", "embedding_profile_revision",
      "embedding_profile_snapshot_digest"
    ) REFERENCES "knowledge_space_profile_revisions" (
      "tenant_id", "knowledge_space_id", "kind", "id", "revision", "snapshot_digest"
    ) ON DELETE RESTRICT,
  ADD CONSTRAINT "document_compilation_attempts_retrieval_profile_fk"
    FOREIGN KEY (
      "tenant_id", "knowledge_space_id", "retrieval_profile_kind",
      "retrieval_profile_revision_id", "retrieval_profile_revision",
      "retrieval_profile_snapshot_digest"
    ) REFERENCES "knowledge_space_profile_revisions" (
      "tenant_id", "knowledge_space_id", "kind", "id", "revision", "snapshot_digest"
    ) ON DELETE RESTRICT;

-- Which profile revisions a publication was built from. The foreign keys without a name in the
-- platform's file carry the names Postgres generated for them there.
CREATE TABLE IF NOT EXISTS "knowledge_space_profile_publication_bindings" (
  "id" UUID NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "changed_kind" VARCHAR(16) NOT NULL,
  "binding_reason" VARCHAR(24) NOT NULL,
  "embedding_profile_kind" VARCHAR(16),
  "embedding_profile_revision_id" UUID,
  "embedding_profile_revision" INTEGER,
  "embedding_profile_snapshot_digest" CHAR(64),
  "retrieval_profile_kind" VARCHAR(16) NOT NULL,
  "retrieval_profile_revision_id" UUID NOT NULL,
  "retrieval_profile_revision" INTEGER NOT NULL,
  "retrieval_profile_snapshot_digest" CHAR(64) NOT NULL,
  "vector_space_id" VARCHAR(87),
  "publication_id" UUID NOT NULL,
  "publication_fingerprint" VARCHAR(86) NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "activated_at" TIMESTAMPTZ,
  CONSTRAINT "knowledge_space_profile_publication_bindings_pkey" PRIMARY KEY ("id"),
  CONSTRAINT "knowledge_space_profile_publication_bindings_kind_ck" CHECK (
    "changed_kind" IN ('embedding', 'retrieval', 'bootstrap', 'content')
    AND "retrieval_profile_kind" = 'retrieval'
    AND ("embedding_profile_kind" IS NULL OR "embedding_profile_kind" = 'embedding')
  ),
  CONSTRAINT "knowledge_space_profile_publication_bindings_reason_ck" CHECK (
    ("binding_reason" = 'candidate-switch' AND "changed_kind" IN ('embedding', 'retrieval'))
    OR ("binding_reason" = 'legacy-bootstrap' AND "changed_kind" = 'bootstrap')
    OR ("binding_reason" = 'content-publication' AND "changed_kind" = 'content')
  ),
  CONSTRAINT "knowledge_space_profile_publication_bindings_shape_ck" CHECK (
    "retrieval_profile_revision" >= 1
    AND (
      (
        "embedding_profile_kind" IS NULL AND "embedding_profile_revision_id" IS NULL
        AND "embedding_profile_revision" IS NULL AND "embedding_profile_snapshot_digest" IS NULL
        AND "vector_space_id" IS NULL
        AND "changed_kind" IN ('retrieval', 'bootstrap', 'content')
      )
      OR (
        "embedding_profile_kind" = 'embedding' AND "embedding_profile_revision_id" IS NOT NULL
        AND "embedding_profile_revision" >= 1 AND "embedding_profile_snapshot_digest" IS NOT NULL
        AND "vector_space_id" IS NOT NULL
      )
    )
    AND (
      "binding_reason" = 'candidate-switch'
      OR (
        "binding_reason" IN ('legacy-bootstrap', 'content-publication')
        AND "activated_at" IS NOT NULL
      )
    )
  ),
  CONSTRAINT "knowledge_space_profile_publi_tenant_id_knowledge_space_id_fkey"
    FOREIGN KEY ("tenant_id", "knowledge_space_id")
    REFERENCES "knowledge_spaces" ("tenant_id", "id") ON DELETE CASCADE,
  CONSTRAINT "knowledge_space_profile_publ_tenant_id_knowledge_space_id_fkey1"
    FOREIGN KEY (
      "tenant_id", "knowledge_space_id", "embedding_profile_kind",
      "embedding_profile_revision_id", "embedding_profile_revision",
      "embedding_profile_snapshot_digest"
    ) REFERENCES "knowledge_space_profile_revisions" (
      "tenant_id", "knowledge_space_id", "kind", "id", "revision", "snapshot_digest"
    ) ON DELETE RESTRICT,
  CONSTRAINT "knowledge_space_profile_publ_tenant_id_knowledge_space_id_fkey2"
    FOREIGN KEY (
      "tenant_id", "knowledge_space_id", "retrieval_profile_kind",
      "retrieval_profile_revision_id", "retrieval_profile_revision",
      "retrieval_profile_snapshot_digest"
    ) REFERENCES "knowledge_space_profile_revisions" (
      "tenant_id", "knowledge_space_id", "kind", "id", "revision", "snapshot_digest"
    ) ON DELETE RESTRICT,
  CONSTRAINT "knowledge_space_profile_publ_tenant_id_knowledge_space_id_fkey3"
    FOREIGN KEY ("tenant_id", "knowledge_space_id", "publication_id", "publication_fingerprint")
    REFERENCES "projection_set_publications" ("tenant_id", "knowledge_space_id", "id", "fingerprint")
    ON DELETE RESTRICT
);

CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_profile_publication_bindings_publication_uq"
  ON "knowledge_space_profile_publication_bindings" (
    "tenant_id", "knowledge_space_id", "publication_id"
  );
CREATE INDEX IF NOT EXISTS "knowledge_space_profile_publication_bindings_activation_idx"
  ON "knowledge_space_profile_publication_bindings" (
    "tenant_id", "knowledge_space_id", "activated_at",
    "embedding_profile_revision", "retrieval_profile_revision", "publication_id"
  );

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0019_profile_publication_bindings', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
