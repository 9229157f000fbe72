-- kfs-worker migration 0040: the platform's 0040_knowledge_space_metadata.
-- A per-space catalog of metadata fields (string, number or time) and the bindings of logical
-- documents to them. Existing documents' user_metadata keys are catalogued once (backfill below);
-- the values themselves stay in user_metadata and are not copied.

CREATE TABLE IF NOT EXISTS "knowledge_space_metadata_fields" (
  "id" UUID NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "name" VARCHAR(255) NOT NULL,
  "type" VARCHAR(16) NOT NULL,
  "row_version" INTEGER NOT NULL DEFAULT 0,
  "created_by_subject_id" VARCHAR(255) NOT NULL,
  "updated_by_subject_id" VARCHAR(255),
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_metadata_fields_pkey" PRIMARY KEY ("id"),
  CONSTRAINT "knowledge_space_metadata_fields_scope_fk"
    FOREIGN KEY ("tenant_id", "knowledge_space_id")
    REFERENCES "knowledge_spaces" ("tenant_id", "id") ON DELETE CASCADE,
  CONSTRAINT "knowledge_space_metadata_fields_scope_id_uq"
    UNIQUE ("tenant_id", "knowledge_space_id", "id"),
  CONSTRAINT "knowledge_space_metadata_fields_name_uq"
    UNIQUE ("tenant_id", "knowledge_space_id", "name"),
  CONSTRAINT "knowledge_space_metadata_fields_type_ck" CHECK (
    "type" IN ('string', 'number', 'time')
  ),
  CONSTRAINT "knowledge_space_metadata_fields_row_version_ck" CHECK ("row_version" >= 0)
);

CREATE INDEX IF NOT EXISTS "knowledge_space_metadata_fields_cursor_idx"
  ON "knowledge_space_metadata_fields" ("tenant_id", "knowledge_space_id", "name", "id");

CREATE TABLE IF NOT EXISTS "logical_document_metadata_bindings" (
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "document_id" UUID NOT NULL,
  "metadata_field_id" UUID NOT NULL,
  "created_by_subject_id" VARCHAR(255) NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "logical_document_metadata_bindings_pkey"
    PRIMARY KEY ("tenant_id", "knowledge_space_id", "document_id", "metadata_field_id"),
  CONSTRAINT "logical_document_metadata_bindings_field_fk"
    FOREIGN KEY ("tenant_id", "knowledge_space_id", "metadata_field_id")
    REFERENCES "knowledge_space_metadata_fields" ("tenant_id", "knowledge_space_id", "id")
    ON DELETE CASCADE,
  CONSTRAINT "logical_document_metadata_bindings_document_fk"
    FOREIGN KEY ("tenant_id", "knowledge_space_id", "document_id")
    REFERENCES "logical_documents" ("tenant_id", "knowledge_space_id", "id")
    ON DELETE CASCADE
);

CREATE INDEX IF NOT EXISTS "logical_document_metadata_bindings_field_idx"
  ON "logical_document_metadata_bindings" (
    "tenant_id", "knowledge_space_id", "metadata_field_id", "document_id"
  );

-- Backfill, as the platform does it:
--   * a candidate key is a user_metadata key matching ^[a-z][a-z0-9_]{0,254}$, other than
--     'provenance' and 'system', counted only where its value is not JSON null;
--   * each value is typed: a JSON number is 'number', a string shaped like an ISO-8601 UTC
--     timestamp (YYYY-MM-DDTHH:MM:SS[.fff]Z) is 'time', any other string is 'string', anything
--     else (boolean, object, array) disqualifies the key;
--   * a key becomes a field of its space when every value it has there has one and the same type;
--     a space gets at most its first 100 such fields by name;
--   * a field's id is derived from md5(tenant_id || ':' || space id || ':' || name), laid out as a
--     UUID with version nibble 5 and variant nibble a, so every replay derives the same id;
--   * created_by_subject_id is 'migration:0040', created_at = updated_at = the transaction time.
-- Every document holding a non-null value under a field's name is then bound to that field.
WITH "candidate_values" AS (
  SELECT
    document."tenant_id",
    document."knowledge_space_id",
    entry."key" AS "name",
    CASE jsonb_typeof(entry."value")
      WHEN 'number' THEN 'number'
      WHEN 'string' THEN
        CASE
          WHEN (entry."value" #>> '{}') ~ '^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$'
            THEN 'time'
          ELSE 'string'
        END
    END AS "value_type"
  FROM "logical_documents" AS document
  CROSS JOIN LATERAL jsonb_each(document."user_metadata") AS entry
  WHERE entry."key" ~ '^[a-z][a-z0-9_]{0,254}$'
    AND entry."key" NOT IN ('provenance', 'system')
    AND jsonb_typeof(entry."value") <> 'null'
),
"consistent_keys" AS (
  SELECT "tenant_id", "knowledge_space_id", "name", min("value_type") AS "value_type"
  FROM "candidate_values"
  GROUP BY "tenant_id", "knowledge_space_id", "name"
  HAVING bool_and("value_type" IS NOT NULL) AND count(DISTINCT "value_type") = 1
),
"first_hundred" AS (
  SELECT
    "tenant_id", "knowledge_space_id", "name", "value_type",
    md5("tenant_id" || ':' || "knowledge_space_id"::text || ':' || "name") AS "digest"
  FROM (
    SELECT
      "consistent_keys".*,
      row_number() OVER (
        PARTITION BY "tenant_id", "knowledge_space_id" ORDER BY "name"
      ) AS "position"
    FROM "consistent_keys"
  ) AS "ranked"
  WHERE "position" <= 100
)
INSERT INTO "knowledge_space_metadata_fields" (
  "id", "tenant_id", "knowledge_space_id", "name", "type", "row_version",
  "created_by_subject_id", "updated_by_subject_id", "created_at", "updated_at"
)
SELECT
  (
    substr("digest", 1, 8) || '-' || substr("digest", 9, 4) || '-5' || substr("digest", 14, 3)
    || '-a' || substr("digest", 18, 3) || '-' || substr("digest", 21, 12)
  )::uuid,
  "tenant_id", "knowledge_space_id", "name", "value_type", 0,
  'migration:0040', NULL, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP
FROM "first_hundred"
ON CONFLICT ("tenant_id", "knowledge_space_id", "name") DO NOTHING;

INSERT INTO "logical_document_metadata_bindings" (
  "tenant_id", "knowledge_space_id", "document_id", "metadata_field_id",
  "created_by_subject_id", "created_at"
)
SELECT
  document."tenant_id", document."knowledge_space_id", document."id", field."id",
  'migration:0040', CURRENT_TIMESTAMP
FROM "logical_documents" AS document
JOIN "knowledge_space_metadata_fields" AS field
  ON field."tenant_id" = document."tenant_id"
 AND field."knowledge_space_id" = document."knowledge_space_id"
 AND document."user_metadata" ? field."name"
 AND jsonb_typeof(document."user_metadata" -> field."name") <> 'null'
ON CONFLICT DO NOTHING;

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0040_knowledge_space_metadata', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
