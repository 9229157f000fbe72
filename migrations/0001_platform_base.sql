-- kfs-worker migration 0001: the older platform tables the job schema builds on.
--
-- The knowledge platform created these tables long before its job migrations (0006 and later,
-- mirrored here from ../shared/reference-schema). kfs-worker has to run against two kinds of
-- database: a fresh one (tests, local development), where this file creates the tables, and an
-- existing platform database, where every table already exists and this file must change
-- nothing the platform owns. Hence:
--   * every table is CREATE TABLE IF NOT EXISTS, and all of its keys, FKs and CHECKs are declared
--     inline, so they only ever appear together with a table this file creates. No constraint is
--     added to an existing platform table by ALTER: it could fail on historical rows, duplicate
--     an equivalent constraint under another name, or (for
--     knowledge_space_manifests_knowledge_space_id_fkey, which 0017 drops on purpose) bring back
--     a constraint a later migration removed.
--   * the only objects added to an adopted table are the CREATE INDEX IF NOT EXISTS helpers at
--     the end. They index only columns the reference migrations or DESIGN.md name (tenant_id,
--     knowledge_space_id, document_asset_id, publication_generation_id, source_id), plus
--     index_projections.node_id (the cascading FK from knowledge_nodes) and
--     index_projections.search_vector (GIN, full-text retrieval).
--   * the columns that the reference migrations add later (knowledge_spaces.revision,
--     answer_traces.subject_id, evidence_bundles.tenant_id, ...) are deliberately absent here, so
--     those migrations introduce them exactly as on the platform.
--   * no column has a default: the platform's writers set every value explicitly, and code that
--     relied on a default would break on an adopted database that does not have it.
--
-- Conventions as in the reference schema: tenant ids VARCHAR(255), ids UUID, times TIMESTAMPTZ.

CREATE TABLE IF NOT EXISTS "knowledge_spaces" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "slug" VARCHAR(255) NOT NULL,
  "name" VARCHAR(255) NOT NULL,
  "description" TEXT,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_spaces_tenant_slug_uq" UNIQUE ("tenant_id", "slug")
);

CREATE TABLE IF NOT EXISTS "sources" (
  "id" UUID PRIMARY KEY NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "type" VARCHAR(32) NOT NULL,
  "status" VARCHAR(16) NOT NULL,
  "name" VARCHAR(255) NOT NULL,
  "uri" TEXT,
  "metadata" JSONB NOT NULL,
  "permission_scope" JSONB NOT NULL,
  "version" INTEGER NOT NULL,
  "credential_ref" TEXT,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "sources_version_ck" CHECK ("version" >= 1),
  CONSTRAINT "sources_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

-- source_id is nullable: deleting a source in 'keep' mode detaches its documents.
CREATE TABLE IF NOT EXISTS "document_assets" (
  "id" UUID PRIMARY KEY NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "source_id" UUID,
  "filename" VARCHAR(1024) NOT NULL,
  "mime_type" VARCHAR(255) NOT NULL,
  "object_key" TEXT NOT NULL,
  "sha256" VARCHAR(64) NOT NULL,
  "size_bytes" BIGINT NOT NULL,
  "version" INTEGER NOT NULL,
  "parser_status" VARCHAR(16) NOT NULL,
  "metadata" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "document_assets_version_ck" CHECK ("version" >= 1),
  CONSTRAINT "document_assets_size_ck" CHECK ("size_bytes" >= 0),
  CONSTRAINT "document_assets_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "document_assets_source_id_fkey"
    FOREIGN KEY ("source_id")
    REFERENCES "sources" ("id") ON DELETE SET NULL
);

-- A publication is one immutable projection set. Its member generations live in metadata.
-- fingerprint is VARCHAR(86) because 0006/0009 reference it with VARCHAR(86) columns.
CREATE TABLE IF NOT EXISTS "projection_set_publications" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "fingerprint" VARCHAR(86) NOT NULL,
  "projection_version" INTEGER NOT NULL,
  "status" VARCHAR(16) NOT NULL,
  "superseded_by_fingerprint" VARCHAR(86),
  "metadata" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "projection_set_publications_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

-- The one published pointer per space. Publishing advances head_revision by compare-and-swap
-- (document_compilation_attempts.base_head_revision; 0 there means "no head yet").
CREATE TABLE IF NOT EXISTS "projection_set_publication_heads" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "publication_id" UUID NOT NULL,
  "head_revision" INTEGER NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "projection_set_publication_heads_space_uq"
    UNIQUE ("tenant_id", "knowledge_space_id"),
  CONSTRAINT "projection_set_publication_heads_revision_ck" CHECK ("head_revision" >= 1),
  CONSTRAINT "projection_set_publication_heads_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "projection_set_publication_heads_publication_id_fkey"
    FOREIGN KEY ("publication_id")
    REFERENCES "projection_set_publications" ("id") ON DELETE RESTRICT
);

-- subject_id/access_channel types match the composite FKs 0015 points at them.
-- 0015 adds the api_key_* binding columns.
CREATE TABLE IF NOT EXISTS "knowledge_space_permission_snapshots" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "subject_id" VARCHAR(255) NOT NULL,
  "access_channel" VARCHAR(16) NOT NULL,
  "revision" INTEGER NOT NULL,
  "status" VARCHAR(16) NOT NULL,
  "expires_at" TIMESTAMPTZ,
  "revoked_at" TIMESTAMPTZ,
  "scopes" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_permission_snapshots_channel_ck"
    CHECK ("access_channel" IN ('interactive', 'service_api', 'mcp', 'agent')),
  CONSTRAINT "knowledge_space_permission_snapshots_revision_ck" CHECK ("revision" >= 1),
  CONSTRAINT "knowledge_space_permission_snapshots_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS "knowledge_space_api_keys" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "name" VARCHAR(255) NOT NULL,
  "key_prefix" VARCHAR(32) NOT NULL,
  "key_hash" CHAR(64) NOT NULL,
  "revision" INTEGER NOT NULL,
  "scopes" JSONB NOT NULL,
  "created_by_subject_id" VARCHAR(255) NOT NULL,
  "expires_at" TIMESTAMPTZ,
  "revoked_at" TIMESTAMPTZ,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_api_keys_revision_ck" CHECK ("revision" >= 1),
  CONSTRAINT "knowledge_space_api_keys_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

-- Answer traces and evidence bundles reference each other loosely (no FKs): 0017 resolves a
-- bundle's owner only when every durable reference agrees. answer_traces has no tenant_id; 0017
-- takes the tenant from knowledge_spaces. 0015 adds the subject/permission columns to
-- answer_traces, 0017 adds tenant_id/knowledge_space_id to evidence_bundles.
CREATE TABLE IF NOT EXISTS "answer_traces" (
  "id" UUID PRIMARY KEY NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "evidence_bundle_id" UUID,
  "query" TEXT NOT NULL,
  "answer" TEXT,
  "metadata" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "answer_traces_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS "evidence_bundles" (
  "id" UUID PRIMARY KEY NOT NULL,
  "trace_id" UUID,
  "payload" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL
);

-- Derived, per-document data. publication_generation_id is NULL on legacy rows (0009 latches
-- such spaces until a bootstrap rebuilds them) and set on rows a generation writer produced.
CREATE TABLE IF NOT EXISTS "page_index_manifests" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "document_version" INTEGER NOT NULL,
  "publication_generation_id" UUID,
  "manifest" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "page_index_manifests_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "page_index_manifests_document_asset_id_fkey"
    FOREIGN KEY ("document_asset_id")
    REFERENCES "document_assets" ("id") ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS "knowledge_nodes" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "document_version" INTEGER NOT NULL,
  "publication_generation_id" UUID,
  "ordinal" INTEGER NOT NULL,
  "heading_path" JSONB NOT NULL,
  "content" TEXT NOT NULL,
  "content_sha256" VARCHAR(64) NOT NULL,
  "token_count" INTEGER NOT NULL,
  "metadata" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_nodes_ordinal_ck" CHECK ("ordinal" >= 0 AND "token_count" >= 0),
  CONSTRAINT "knowledge_nodes_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "knowledge_nodes_document_asset_id_fkey"
    FOREIGN KEY ("document_asset_id")
    REFERENCES "document_assets" ("id") ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS "index_projections" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "publication_generation_id" UUID,
  "node_id" UUID NOT NULL,
  "search_vector" TSVECTOR NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "index_projections_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "index_projections_document_asset_id_fkey"
    FOREIGN KEY ("document_asset_id")
    REFERENCES "document_assets" ("id") ON DELETE CASCADE,
  CONSTRAINT "index_projections_node_id_fkey"
    FOREIGN KEY ("node_id")
    REFERENCES "knowledge_nodes" ("id") ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS "document_outlines" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "document_version" INTEGER NOT NULL,
  "publication_generation_id" UUID,
  "outline" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "document_outlines_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "document_outlines_document_asset_id_fkey"
    FOREIGN KEY ("document_asset_id")
    REFERENCES "document_assets" ("id") ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS "document_multimodal_manifests" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "document_version" INTEGER NOT NULL,
  "publication_generation_id" UUID,
  "manifest" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "document_multimodal_manifests_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "document_multimodal_manifests_document_asset_id_fkey"
    FOREIGN KEY ("document_asset_id")
    REFERENCES "document_assets" ("id") ON DELETE CASCADE
);

-- A path in the space's file-system view. Directory entries have no document.
CREATE TABLE IF NOT EXISTS "knowledge_paths" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "document_asset_id" UUID,
  "publication_generation_id" UUID,
  "path" TEXT NOT NULL,
  "metadata" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_paths_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "knowledge_paths_document_asset_id_fkey"
    FOREIGN KEY ("document_asset_id")
    REFERENCES "document_assets" ("id") ON DELETE CASCADE
);

-- Graph entities and relations may span documents (the reason 0009 rebuilds legacy spaces
-- instead of adopting them), so they carry no document_asset_id.
CREATE TABLE IF NOT EXISTS "graph_entities" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "publication_generation_id" UUID,
  "name" TEXT NOT NULL,
  "entity_type" VARCHAR(64) NOT NULL,
  "properties" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "graph_entities_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS "graph_relations" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "publication_generation_id" UUID,
  "source_entity_id" UUID NOT NULL,
  "target_entity_id" UUID NOT NULL,
  "relation_type" VARCHAR(64) NOT NULL,
  "properties" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "graph_relations_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE,
  CONSTRAINT "graph_relations_source_entity_id_fkey"
    FOREIGN KEY ("source_entity_id")
    REFERENCES "graph_entities" ("id") ON DELETE CASCADE,
  CONSTRAINT "graph_relations_target_entity_id_fkey"
    FOREIGN KEY ("target_entity_id")
    REFERENCES "graph_entities" ("id") ON DELETE CASCADE
);

-- The original schema constrained only the space UUID. 0017 (as on the platform) installs the
-- tenant-scoped FK and drops this one by its exact name, so the name must stay as it is.
CREATE TABLE IF NOT EXISTS "knowledge_space_manifests" (
  "id" UUID PRIMARY KEY NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "version" INTEGER NOT NULL,
  "manifest" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_manifests_version_ck" CHECK ("version" >= 1),
  CONSTRAINT "knowledge_space_manifests_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id")
    REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

-- Helper indexes. Space + generation serves 0009's legacy scan ("any NULL-generation rows in this
-- space?"), generation cleanup and published reads (a space id belongs to exactly one tenant, so
-- tenant-scoped queries use it too); document_asset_id and node_id serve the per-document
-- deletion pages and the cascading FKs.
CREATE INDEX IF NOT EXISTS "document_assets_source_id_idx"
  ON "document_assets" ("source_id", "id");
CREATE INDEX IF NOT EXISTS "knowledge_nodes_space_generation_idx"
  ON "knowledge_nodes" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "knowledge_nodes_document_idx"
  ON "knowledge_nodes" ("document_asset_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "index_projections_space_generation_idx"
  ON "index_projections" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "index_projections_document_idx"
  ON "index_projections" ("document_asset_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "index_projections_node_idx"
  ON "index_projections" ("node_id");
CREATE INDEX IF NOT EXISTS "index_projections_search_vector_idx"
  ON "index_projections" USING GIN ("search_vector");
CREATE INDEX IF NOT EXISTS "document_outlines_space_generation_idx"
  ON "document_outlines" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "document_outlines_document_idx"
  ON "document_outlines" ("document_asset_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "document_multimodal_manifests_space_generation_idx"
  ON "document_multimodal_manifests" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "document_multimodal_manifests_document_idx"
  ON "document_multimodal_manifests" ("document_asset_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "page_index_manifests_space_generation_idx"
  ON "page_index_manifests" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "knowledge_paths_space_generation_idx"
  ON "knowledge_paths" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "knowledge_paths_document_idx"
  ON "knowledge_paths" ("document_asset_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "graph_entities_space_generation_idx"
  ON "graph_entities" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "graph_relations_space_generation_idx"
  ON "graph_relations" ("knowledge_space_id", "publication_generation_id", "id");
CREATE INDEX IF NOT EXISTS "knowledge_space_manifests_space_idx"
  ON "knowledge_space_manifests" ("tenant_id", "knowledge_space_id", "id");
