-- kfs-worker migration 0001: the platform's own tables that its job migrations build on.
--
-- Every table here is one the platform's migrations 0001-0014 create (the job tables of 0006, 0009,
-- 0015, 0017 and 0018 and the tables those files create come in the migrations of the same
-- numbers). Each is written in the form the platform's schema has after its migration 0018:
-- the same columns, types, NOT NULLs and defaults, the same constraints under the same names
-- (including the names Postgres generated for the platform's unnamed foreign keys), and the same
-- indexes. Definitions are spelled the way Postgres prints them back, so that they can be checked
-- against ../shared/reference-schema/platform-0018.schema.json one for one.
--
-- A database the platform built already has all of these tables: `kfs-worker migrate` checks that
-- first (see src/db/migrate.rs), and then every statement below is a no-op, because each table is
-- CREATE TABLE IF NOT EXISTS with all its keys and constraints inline, and each index is
-- CREATE INDEX IF NOT EXISTS. Nothing here ALTERs a table that already exists.
--
-- The platform's migrations do not create the vector extension (its deployments install it);
-- a fresh database gets it here, because index_projections has two vector columns.

CREATE EXTENSION IF NOT EXISTS "vector";

-- knowledge_spaces (platform migration 0001)
CREATE TABLE IF NOT EXISTS "knowledge_spaces" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "deleting_at" TIMESTAMPTZ,
  "deletion_job_id" UUID,
  "description" TEXT,
  "lifecycle_state" VARCHAR(16) NOT NULL DEFAULT 'active',
  "name" TEXT NOT NULL,
  "revision" INTEGER NOT NULL DEFAULT 1,
  "slug" TEXT NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_spaces_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_spaces_deletion_lifecycle_ck" CHECK (((revision >= 1) AND ((((lifecycle_state)::text = 'active'::text) AND (deletion_job_id IS NULL) AND (deleting_at IS NULL)) OR (((lifecycle_state)::text = 'deleting'::text) AND (deletion_job_id IS NOT NULL) AND (deleting_at IS NOT NULL))))),
  CONSTRAINT "knowledge_spaces_tenant_id_length_ck" CHECK ((char_length((tenant_id)::text) <= 255))
);
CREATE INDEX IF NOT EXISTS "knowledge_spaces_lifecycle_idx" ON "knowledge_spaces" USING btree (tenant_id, lifecycle_state, updated_at, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_spaces_tenant_id_uq" ON "knowledge_spaces" USING btree (tenant_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_spaces_tenant_slug_uq" ON "knowledge_spaces" USING btree (tenant_id, slug);

-- knowledge_space_manifests (platform migration 0001)
CREATE TABLE IF NOT EXISTS "knowledge_space_manifests" (
  "id" UUID NOT NULL,
  "consistency_policy" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "encryption_policy" JSONB NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "manifest_version" INTEGER NOT NULL,
  "metadata" JSONB NOT NULL,
  "metadata_dialect" TEXT NOT NULL,
  "min_client_version" TEXT NOT NULL,
  "node_schema_version" INTEGER NOT NULL,
  "object_key_prefix" TEXT NOT NULL,
  "parser_policy_version" TEXT NOT NULL,
  "projection_set_version" TEXT NOT NULL,
  "quota_policy" JSONB NOT NULL,
  "retention_policy" JSONB NOT NULL,
  "storage_provider" TEXT NOT NULL,
  "tenant_id" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_manifests_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_manifests_space_fk" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "knowledge_space_manifests_tenant_space_idx" ON "knowledge_space_manifests" USING btree (tenant_id, knowledge_space_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_manifests_tenant_space_uq" ON "knowledge_space_manifests" USING btree (tenant_id, knowledge_space_id);

-- sources (platform migration 0001)
CREATE TABLE IF NOT EXISTS "sources" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "credential_ref" TEXT,
  "deleting_at" TIMESTAMPTZ,
  "deletion_job_id" UUID,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "name" TEXT NOT NULL,
  "permission_scope" JSONB NOT NULL,
  "status" TEXT NOT NULL,
  "type" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "uri" TEXT NOT NULL,
  "version" INTEGER NOT NULL,
  CONSTRAINT "sources_pkey" PRIMARY KEY (id),
  CONSTRAINT "sources_deletion_lifecycle_ck" CHECK ((((status = 'deleting'::text) AND (deletion_job_id IS NOT NULL) AND (deleting_at IS NOT NULL)) OR ((status <> 'deleting'::text) AND (deletion_job_id IS NULL) AND (deleting_at IS NULL)))),
  CONSTRAINT "sources_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "sources_credential_backfill_discovery_idx" ON "sources" USING btree (id) WHERE (credential_ref IS NULL);
CREATE UNIQUE INDEX IF NOT EXISTS "sources_credential_ref_uq" ON "sources" USING btree (credential_ref) WHERE (credential_ref IS NOT NULL);
CREATE INDEX IF NOT EXISTS "sources_deletion_job_idx" ON "sources" USING btree (knowledge_space_id, deletion_job_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "sources_space_id_uq" ON "sources" USING btree (knowledge_space_id, id);
CREATE INDEX IF NOT EXISTS "sources_space_status_idx" ON "sources" USING btree (knowledge_space_id, status);

-- resource_mounts (platform migration 0001)
CREATE TABLE IF NOT EXISTS "resource_mounts" (
  "id" UUID NOT NULL,
  "cache_policy" JSONB NOT NULL,
  "capabilities" JSONB NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "freshness_policy" JSONB NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "last_synced_at" TIMESTAMPTZ,
  "metadata" JSONB NOT NULL,
  "mode" TEXT NOT NULL,
  "mount_path" TEXT NOT NULL,
  "permission_scope" JSONB NOT NULL,
  "permission_snapshot_version" INTEGER NOT NULL,
  "provider" TEXT NOT NULL,
  "resource_type" TEXT NOT NULL,
  "source_pointer" TEXT NOT NULL,
  "tenant_id" TEXT NOT NULL,
  CONSTRAINT "resource_mounts_pkey" PRIMARY KEY (id),
  CONSTRAINT "resource_mounts_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "resource_mounts_permission_scope_idx" ON "resource_mounts" USING gin (permission_scope);
CREATE UNIQUE INDEX IF NOT EXISTS "resource_mounts_space_path_uq" ON "resource_mounts" USING btree (knowledge_space_id, mount_path);
CREATE INDEX IF NOT EXISTS "resource_mounts_space_type_path_idx" ON "resource_mounts" USING btree (knowledge_space_id, resource_type, mount_path, id);

-- document_assets (platform migration 0001)
CREATE TABLE IF NOT EXISTS "document_assets" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "deleting_at" TIMESTAMPTZ,
  "deletion_job_id" UUID,
  "filename" TEXT NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "lifecycle_state" VARCHAR(16) NOT NULL DEFAULT 'active',
  "metadata" JSONB NOT NULL,
  "mime_type" TEXT NOT NULL,
  "object_key" TEXT NOT NULL,
  "parser_status" TEXT NOT NULL,
  "row_version" INTEGER NOT NULL DEFAULT 1,
  "sha256" TEXT NOT NULL,
  "size_bytes" INTEGER NOT NULL,
  "source_id" UUID,
  "updated_at" TIMESTAMPTZ,
  "version" INTEGER NOT NULL,
  CONSTRAINT "document_assets_pkey" PRIMARY KEY (id),
  CONSTRAINT "document_assets_deletion_lifecycle_ck" CHECK (((row_version >= 1) AND ((((lifecycle_state)::text = 'active'::text) AND (deletion_job_id IS NULL) AND (deleting_at IS NULL)) OR (((lifecycle_state)::text = 'deleting'::text) AND (deletion_job_id IS NOT NULL) AND (deleting_at IS NOT NULL))))),
  CONSTRAINT "document_assets_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "document_assets_lifecycle_idx" ON "document_assets" USING btree (knowledge_space_id, lifecycle_state, source_id, version, id);
CREATE UNIQUE INDEX IF NOT EXISTS "document_assets_space_id_version_uq" ON "document_assets" USING btree (knowledge_space_id, id, version);
CREATE INDEX IF NOT EXISTS "document_assets_space_source_version_idx" ON "document_assets" USING btree (knowledge_space_id, source_id, version, id);
CREATE INDEX IF NOT EXISTS "document_assets_space_status_created_idx" ON "document_assets" USING btree (knowledge_space_id, parser_status, created_at, id);

-- parse_artifacts (platform migration 0001)
CREATE TABLE IF NOT EXISTS "parse_artifacts" (
  "id" UUID NOT NULL,
  "artifact_hash" TEXT NOT NULL,
  "content_type" TEXT NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "elements" JSONB NOT NULL,
  "metadata" JSONB NOT NULL,
  "parser" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ,
  "version" INTEGER NOT NULL,
  CONSTRAINT "parse_artifacts_pkey" PRIMARY KEY (id),
  CONSTRAINT "parse_artifacts_document_asset_id_fkey" FOREIGN KEY (document_asset_id) REFERENCES document_assets(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "parse_artifacts_asset_version_uq" ON "parse_artifacts" USING btree (document_asset_id, version);
CREATE INDEX IF NOT EXISTS "parse_artifacts_hash_idx" ON "parse_artifacts" USING btree (artifact_hash);

-- document_multimodal_manifests (platform migration 0001)
CREATE TABLE IF NOT EXISTS "document_multimodal_manifests" (
  "id" UUID NOT NULL,
  "artifact_hash" TEXT NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "items" JSONB NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "manifest_version" TEXT NOT NULL,
  "metadata" JSONB NOT NULL,
  "parse_artifact_id" UUID NOT NULL,
  "publication_generation_id" UUID,
  "updated_at" TIMESTAMPTZ,
  "version" INTEGER NOT NULL,
  CONSTRAINT "document_multimodal_manifests_pkey" PRIMARY KEY (id),
  CONSTRAINT "document_multimodal_pub_gen_nonzero_ck" CHECK (((publication_generation_id IS NULL) OR (publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "document_multimodal_manifests_document_asset_id_fkey" FOREIGN KEY (document_asset_id) REFERENCES document_assets(id) ON DELETE CASCADE,
  CONSTRAINT "document_multimodal_manifests_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "document_multimodal_manifests_parse_artifact_id_fkey" FOREIGN KEY (parse_artifact_id) REFERENCES parse_artifacts(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "document_multimodal_manifests_asset_version_uq" ON "document_multimodal_manifests" USING btree (document_asset_id, version, COALESCE(publication_generation_id, '00000000-0000-0000-0000-000000000000'::uuid));
CREATE INDEX IF NOT EXISTS "document_multimodal_manifests_space_asset_idx" ON "document_multimodal_manifests" USING btree (knowledge_space_id, document_asset_id, id);

-- artifact_segments (platform migration 0001)
CREATE TABLE IF NOT EXISTS "artifact_segments" (
  "id" UUID NOT NULL,
  "artifact_hash" TEXT NOT NULL,
  "checksum" TEXT NOT NULL,
  "content_encoding" TEXT NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "end_offset" INTEGER,
  "inline_text" TEXT,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "object_key" TEXT,
  "parse_artifact_id" UUID NOT NULL,
  "segment_index" INTEGER NOT NULL,
  "segment_type" TEXT NOT NULL,
  "size_bytes" INTEGER,
  "source_location" JSONB NOT NULL,
  "start_offset" INTEGER,
  "updated_at" TIMESTAMPTZ,
  CONSTRAINT "artifact_segments_pkey" PRIMARY KEY (id),
  CONSTRAINT "artifact_segments_document_asset_id_fkey" FOREIGN KEY (document_asset_id) REFERENCES document_assets(id) ON DELETE CASCADE,
  CONSTRAINT "artifact_segments_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "artifact_segments_parse_artifact_id_fkey" FOREIGN KEY (parse_artifact_id) REFERENCES parse_artifacts(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "artifact_segments_artifact_index_uq" ON "artifact_segments" USING btree (parse_artifact_id, segment_index);
CREATE INDEX IF NOT EXISTS "artifact_segments_document_source_idx" ON "artifact_segments" USING btree (document_asset_id, start_offset, id);
CREATE INDEX IF NOT EXISTS "artifact_segments_space_artifact_index_idx" ON "artifact_segments" USING btree (knowledge_space_id, parse_artifact_id, segment_index, id);
CREATE INDEX IF NOT EXISTS "artifact_segments_space_checksum_idx" ON "artifact_segments" USING btree (knowledge_space_id, checksum, id);

-- knowledge_space_staged_commits (platform migration 0001)
CREATE TABLE IF NOT EXISTS "knowledge_space_staged_commits" (
  "id" UUID NOT NULL,
  "checksum" TEXT,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID,
  "error_code" TEXT,
  "error_message" TEXT,
  "expires_at" TIMESTAMPTZ,
  "idempotency_key" TEXT NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "operation_type" TEXT NOT NULL,
  "parse_artifact_id" UUID,
  "projection_fingerprint" TEXT,
  "published_object_key" TEXT,
  "raw_object_key" TEXT,
  "size_bytes" INTEGER,
  "status" TEXT NOT NULL,
  "tenant_id" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_staged_commits_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_staged_commits_document_asset_id_fkey" FOREIGN KEY (document_asset_id) REFERENCES document_assets(id) ON DELETE SET NULL,
  CONSTRAINT "knowledge_space_staged_commits_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "knowledge_space_staged_commits_parse_artifact_id_fkey" FOREIGN KEY (parse_artifact_id) REFERENCES parse_artifacts(id) ON DELETE SET NULL
);
CREATE INDEX IF NOT EXISTS "knowledge_space_staged_commits_document_idx" ON "knowledge_space_staged_commits" USING btree (document_asset_id, id);
CREATE INDEX IF NOT EXISTS "knowledge_space_staged_commits_expiry_idx" ON "knowledge_space_staged_commits" USING btree (tenant_id, knowledge_space_id, expires_at, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_staged_commits_idempotency_uq" ON "knowledge_space_staged_commits" USING btree (tenant_id, knowledge_space_id, idempotency_key);
CREATE INDEX IF NOT EXISTS "knowledge_space_staged_commits_status_updated_idx" ON "knowledge_space_staged_commits" USING btree (tenant_id, knowledge_space_id, status, updated_at, id);

-- knowledge_fs_sessions (platform migration 0001)
CREATE TABLE IF NOT EXISTS "knowledge_fs_sessions" (
  "id" UUID NOT NULL,
  "client_kind" TEXT NOT NULL,
  "client_version" TEXT NOT NULL,
  "consistency_class" TEXT NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "expires_at" TIMESTAMPTZ NOT NULL,
  "heartbeat_at" TIMESTAMPTZ NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "permission_snapshot" JSONB NOT NULL,
  "subject" JSONB NOT NULL,
  "tenant_id" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_fs_sessions_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_fs_sessions_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "knowledge_fs_sessions_expiry_idx" ON "knowledge_fs_sessions" USING btree (tenant_id, expires_at, id);
CREATE INDEX IF NOT EXISTS "knowledge_fs_sessions_space_expiry_idx" ON "knowledge_fs_sessions" USING btree (tenant_id, knowledge_space_id, expires_at, id);

-- knowledge_fs_leases (platform migration 0001)
CREATE TABLE IF NOT EXISTS "knowledge_fs_leases" (
  "id" UUID NOT NULL,
  "acquired_at" TIMESTAMPTZ NOT NULL,
  "expires_at" TIMESTAMPTZ NOT NULL,
  "heartbeat_at" TIMESTAMPTZ NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "lease_type" TEXT NOT NULL,
  "metadata" JSONB NOT NULL,
  "session_id" UUID NOT NULL,
  "status" TEXT NOT NULL,
  "target_id" TEXT NOT NULL,
  "target_type" TEXT NOT NULL,
  "target_version" INTEGER,
  "tenant_id" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "virtual_path" TEXT NOT NULL,
  CONSTRAINT "knowledge_fs_leases_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_fs_leases_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "knowledge_fs_leases_session_id_fkey" FOREIGN KEY (session_id) REFERENCES knowledge_fs_sessions(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "knowledge_fs_leases_active_path_idx" ON "knowledge_fs_leases" USING btree (tenant_id, knowledge_space_id, status, virtual_path, expires_at, id);
CREATE INDEX IF NOT EXISTS "knowledge_fs_leases_expiry_idx" ON "knowledge_fs_leases" USING btree (tenant_id, expires_at, id);
CREATE INDEX IF NOT EXISTS "knowledge_fs_leases_session_idx" ON "knowledge_fs_leases" USING btree (tenant_id, session_id, status, id);

-- knowledge_nodes (platform migration 0001)
CREATE TABLE IF NOT EXISTS "knowledge_nodes" (
  "id" UUID NOT NULL,
  "artifact_hash" TEXT NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "end_offset" INTEGER NOT NULL,
  "kind" TEXT NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "parse_artifact_id" UUID NOT NULL,
  "permission_scope" JSONB NOT NULL,
  "publication_generation_id" UUID,
  "source_location" JSONB NOT NULL,
  "start_offset" INTEGER NOT NULL,
  "text" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ,
  CONSTRAINT "knowledge_nodes_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_nodes_pub_gen_nonzero_ck" CHECK (((publication_generation_id IS NULL) OR (publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "knowledge_nodes_document_asset_id_fkey" FOREIGN KEY (document_asset_id) REFERENCES document_assets(id) ON DELETE CASCADE,
  CONSTRAINT "knowledge_nodes_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "knowledge_nodes_parse_artifact_id_fkey" FOREIGN KEY (parse_artifact_id) REFERENCES parse_artifacts(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_nodes_artifact_kind_offsets_uq" ON "knowledge_nodes" USING btree (knowledge_space_id, parse_artifact_id, kind, start_offset, end_offset, COALESCE(publication_generation_id, '00000000-0000-0000-0000-000000000000'::uuid));
CREATE INDEX IF NOT EXISTS "knowledge_nodes_artifact_offset_idx" ON "knowledge_nodes" USING btree (knowledge_space_id, parse_artifact_id, publication_generation_id, start_offset, id);
CREATE INDEX IF NOT EXISTS "knowledge_nodes_permission_scope_idx" ON "knowledge_nodes" USING gin (permission_scope);
CREATE INDEX IF NOT EXISTS "knowledge_nodes_space_asset_kind_idx" ON "knowledge_nodes" USING btree (knowledge_space_id, publication_generation_id, document_asset_id, kind, id);

-- index_projections (platform migration 0001)
CREATE TABLE IF NOT EXISTS "index_projections" (
  "id" UUID NOT NULL,
  "dense_vector" vector,
  "fts_document" TSVECTOR,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "model" TEXT,
  "node_id" UUID NOT NULL,
  "projection_version" INTEGER NOT NULL,
  "publication_generation_id" UUID,
  "status" TEXT NOT NULL,
  "type" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ,
  "visual_vector" vector,
  CONSTRAINT "index_projections_pkey" PRIMARY KEY (id),
  CONSTRAINT "index_projections_pub_gen_nonzero_ck" CHECK (((publication_generation_id IS NULL) OR (publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "index_projections_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "index_projections_node_id_fkey" FOREIGN KEY (node_id) REFERENCES knowledge_nodes(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "index_projections_fts_backfill_idx" ON "index_projections" USING btree (knowledge_space_id, id);
CREATE INDEX IF NOT EXISTS "index_projections_fts_document_idx" ON "index_projections" USING gin (fts_document);
CREATE INDEX IF NOT EXISTS "index_projections_node_type_version_idx" ON "index_projections" USING btree (node_id, type, projection_version);
CREATE UNIQUE INDEX IF NOT EXISTS "index_projections_node_type_version_model_uq" ON "index_projections" USING btree (node_id, type, projection_version, COALESCE(model, ''::text), COALESCE(publication_generation_id, '00000000-0000-0000-0000-000000000000'::uuid));
CREATE UNIQUE INDEX IF NOT EXISTS "index_projections_space_id_uq" ON "index_projections" USING btree (knowledge_space_id, id);
CREATE INDEX IF NOT EXISTS "index_projections_space_type_status_idx" ON "index_projections" USING btree (knowledge_space_id, publication_generation_id, type, status, node_id, id);

-- embedding_models (platform migration 0001)
CREATE TABLE IF NOT EXISTS "embedding_models" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "dimension" INTEGER NOT NULL,
  "max_tokens" INTEGER NOT NULL,
  "metadata" JSONB NOT NULL,
  "metric" TEXT NOT NULL,
  "model_id" TEXT NOT NULL,
  "provider" TEXT NOT NULL,
  "status" TEXT NOT NULL,
  "tokenizer" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "version" TEXT NOT NULL,
  CONSTRAINT "embedding_models_pkey" PRIMARY KEY (id)
);
CREATE UNIQUE INDEX IF NOT EXISTS "embedding_models_model_version_uq" ON "embedding_models" USING btree (model_id, version);
CREATE INDEX IF NOT EXISTS "embedding_models_status_model_idx" ON "embedding_models" USING btree (status, model_id, id);
CREATE INDEX IF NOT EXISTS "embedding_models_status_provider_idx" ON "embedding_models" USING btree (status, provider, model_id, id);

-- knowledge_paths (platform migration 0001)
CREATE TABLE IF NOT EXISTS "knowledge_paths" (
  "id" UUID NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "publication_generation_id" UUID,
  "resource_type" TEXT NOT NULL,
  "target_id" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ,
  "version" INTEGER,
  "view_name" TEXT NOT NULL,
  "view_type" TEXT NOT NULL,
  "virtual_path" TEXT NOT NULL,
  CONSTRAINT "knowledge_paths_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_paths_pub_gen_nonzero_ck" CHECK (((publication_generation_id IS NULL) OR (publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "knowledge_paths_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_paths_space_path_uq" ON "knowledge_paths" USING btree (knowledge_space_id, virtual_path, COALESCE(publication_generation_id, '00000000-0000-0000-0000-000000000000'::uuid));
CREATE INDEX IF NOT EXISTS "knowledge_paths_space_view_path_idx" ON "knowledge_paths" USING btree (knowledge_space_id, publication_generation_id, view_type, view_name, virtual_path, id);
CREATE INDEX IF NOT EXISTS "knowledge_paths_target_idx" ON "knowledge_paths" USING btree (resource_type, target_id);

-- evidence_bundles (platform migration 0001)
CREATE TABLE IF NOT EXISTS "evidence_bundles" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "items" JSONB NOT NULL,
  "knowledge_space_id" UUID,
  "missing_evidence" JSONB NOT NULL,
  "query" TEXT NOT NULL,
  "state" TEXT NOT NULL,
  "tenant_id" VARCHAR(255),
  "trace_id" UUID,
  "updated_at" TIMESTAMPTZ,
  CONSTRAINT "evidence_bundles_pkey" PRIMARY KEY (id),
  CONSTRAINT "evidence_bundles_scope_pair_ck" CHECK ((((tenant_id IS NULL) AND (knowledge_space_id IS NULL)) OR ((tenant_id IS NOT NULL) AND (knowledge_space_id IS NOT NULL)))),
  CONSTRAINT "evidence_bundles_scope_fk" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "evidence_bundles_scope_created_idx" ON "evidence_bundles" USING btree (tenant_id, knowledge_space_id, created_at, id);
CREATE INDEX IF NOT EXISTS "evidence_bundles_state_created_idx" ON "evidence_bundles" USING btree (state, created_at, id);
CREATE INDEX IF NOT EXISTS "evidence_bundles_trace_idx" ON "evidence_bundles" USING btree (trace_id);

-- golden_questions (platform migration 0001)
CREATE TABLE IF NOT EXISTS "golden_questions" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "expected_evidence_ids" JSONB NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "question" TEXT NOT NULL,
  "tags" JSONB NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "golden_questions_pkey" PRIMARY KEY (id),
  CONSTRAINT "golden_questions_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "golden_questions_space_created_idx" ON "golden_questions" USING btree (knowledge_space_id, created_at, id);
CREATE INDEX IF NOT EXISTS "golden_questions_space_id_idx" ON "golden_questions" USING btree (knowledge_space_id, id);

-- graph_entities (platform migration 0001)
CREATE TABLE IF NOT EXISTS "graph_entities" (
  "id" UUID NOT NULL,
  "aliases" JSONB NOT NULL,
  "canonical_key" TEXT NOT NULL,
  "confidence" DOUBLE PRECISION NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "extraction_version" INTEGER NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "name" TEXT NOT NULL,
  "permission_scope" JSONB NOT NULL,
  "publication_generation_id" UUID,
  "source_node_ids" JSONB NOT NULL,
  "type" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "graph_entities_pkey" PRIMARY KEY (id),
  CONSTRAINT "graph_entities_pub_gen_nonzero_ck" CHECK (((publication_generation_id IS NULL) OR (publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "graph_entities_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "graph_entities_permission_scope_idx" ON "graph_entities" USING gin (permission_scope);
CREATE UNIQUE INDEX IF NOT EXISTS "graph_entities_space_key_uq" ON "graph_entities" USING btree (knowledge_space_id, canonical_key, COALESCE(publication_generation_id, '00000000-0000-0000-0000-000000000000'::uuid));
CREATE INDEX IF NOT EXISTS "graph_entities_space_type_name_idx" ON "graph_entities" USING btree (knowledge_space_id, publication_generation_id, type, name, id);

-- graph_relations (platform migration 0001)
CREATE TABLE IF NOT EXISTS "graph_relations" (
  "id" UUID NOT NULL,
  "confidence" DOUBLE PRECISION NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "extraction_version" INTEGER NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "object_entity_id" UUID NOT NULL,
  "permission_scope" JSONB NOT NULL,
  "publication_generation_id" UUID,
  "source_node_ids" JSONB NOT NULL,
  "subject_entity_id" UUID NOT NULL,
  "type" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "graph_relations_pkey" PRIMARY KEY (id),
  CONSTRAINT "graph_relations_pub_gen_nonzero_ck" CHECK (((publication_generation_id IS NULL) OR (publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "graph_relations_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "graph_relations_object_entity_id_fkey" FOREIGN KEY (object_entity_id) REFERENCES graph_entities(id) ON DELETE CASCADE,
  CONSTRAINT "graph_relations_subject_entity_id_fkey" FOREIGN KEY (subject_entity_id) REFERENCES graph_entities(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "graph_relations_object_traversal_idx" ON "graph_relations" USING btree (knowledge_space_id, publication_generation_id, object_entity_id, type, subject_entity_id, id);
CREATE INDEX IF NOT EXISTS "graph_relations_permission_scope_idx" ON "graph_relations" USING gin (permission_scope);
CREATE UNIQUE INDEX IF NOT EXISTS "graph_relations_space_edge_version_uq" ON "graph_relations" USING btree (knowledge_space_id, subject_entity_id, type, object_entity_id, extraction_version, COALESCE(publication_generation_id, '00000000-0000-0000-0000-000000000000'::uuid));
CREATE INDEX IF NOT EXISTS "graph_relations_subject_traversal_idx" ON "graph_relations" USING btree (knowledge_space_id, publication_generation_id, subject_entity_id, type, object_entity_id, id);

-- failed_queries (platform migration 0001)
CREATE TABLE IF NOT EXISTS "failed_queries" (
  "id" UUID NOT NULL,
  "answer_trace_id" UUID,
  "created_at" TIMESTAMPTZ NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "mode" TEXT NOT NULL,
  "query" TEXT NOT NULL,
  "status" TEXT NOT NULL,
  "trigger" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "failed_queries_pkey" PRIMARY KEY (id),
  CONSTRAINT "failed_queries_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);

-- document_outlines (platform migration 0001)
CREATE TABLE IF NOT EXISTS "document_outlines" (
  "id" UUID NOT NULL,
  "artifact_hash" TEXT NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "nodes" JSONB NOT NULL,
  "outline_version" TEXT NOT NULL,
  "parse_artifact_id" UUID NOT NULL,
  "publication_generation_id" UUID,
  "updated_at" TIMESTAMPTZ,
  "version" INTEGER NOT NULL,
  CONSTRAINT "document_outlines_pkey" PRIMARY KEY (id),
  CONSTRAINT "document_outlines_pub_gen_nonzero_ck" CHECK (((publication_generation_id IS NULL) OR (publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "document_outlines_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "document_outlines_asset_version_uq" ON "document_outlines" USING btree (document_asset_id, version, COALESCE(publication_generation_id, '00000000-0000-0000-0000-000000000000'::uuid));

-- projection_set_publications (platform migration 0003)
CREATE TABLE IF NOT EXISTS "projection_set_publications" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "fingerprint" VARCHAR(86) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "metadata" JSONB NOT NULL,
  "projection_version" INTEGER NOT NULL,
  "status" VARCHAR(16) NOT NULL,
  "superseded_by_fingerprint" VARCHAR(86),
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "projection_set_publications_pkey" PRIMARY KEY (id),
  CONSTRAINT "projection_set_publications_status_ck" CHECK ((status IN ('candidate', 'inactive', 'published', 'superseded', 'validating'))),
  CONSTRAINT "projection_set_publications_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "projection_set_publications_space_fingerprint_uq" ON "projection_set_publications" USING btree (tenant_id, knowledge_space_id, fingerprint);
CREATE UNIQUE INDEX IF NOT EXISTS "projection_set_publications_space_id_fingerprint_uq" ON "projection_set_publications" USING btree (tenant_id, knowledge_space_id, id, fingerprint);
CREATE UNIQUE INDEX IF NOT EXISTS "projection_set_publications_space_id_uq" ON "projection_set_publications" USING btree (tenant_id, knowledge_space_id, id);
CREATE INDEX IF NOT EXISTS "projection_set_publications_space_status_updated_idx" ON "projection_set_publications" USING btree (tenant_id, knowledge_space_id, status, updated_at, fingerprint, id);

-- projection_set_publication_heads (platform migration 0003)
CREATE TABLE IF NOT EXISTS "projection_set_publication_heads" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "head_revision" INTEGER NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "publication_id" UUID NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "projection_set_publication_heads_pkey" PRIMARY KEY (id),
  CONSTRAINT "projection_set_publication_he_tenant_id_knowledge_space_id_fkey" FOREIGN KEY (tenant_id, knowledge_space_id, publication_id) REFERENCES projection_set_publications(tenant_id, knowledge_space_id, id) ON DELETE RESTRICT,
  CONSTRAINT "projection_set_publication_heads_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "projection_set_publication_heads_publication_uq" ON "projection_set_publication_heads" USING btree (publication_id);
CREATE UNIQUE INDEX IF NOT EXISTS "projection_set_publication_heads_space_uq" ON "projection_set_publication_heads" USING btree (tenant_id, knowledge_space_id);

-- projection_set_publication_members (platform migration 0004)
CREATE TABLE IF NOT EXISTS "projection_set_publication_members" (
  "component_key" UUID NOT NULL,
  "component_type" VARCHAR(64) NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID,
  "generation_id" UUID NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "publication_id" UUID NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  CONSTRAINT "publication_members_gen_nonzero_ck" CHECK ((generation_id <> '00000000-0000-0000-0000-000000000000'::uuid)),
  CONSTRAINT "projection_set_publication_me_tenant_id_knowledge_space_id_fkey" FOREIGN KEY (tenant_id, knowledge_space_id, publication_id) REFERENCES projection_set_publications(tenant_id, knowledge_space_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "projection_set_publication_members_component_uq" ON "projection_set_publication_members" USING btree (publication_id, component_type, component_key);
CREATE INDEX IF NOT EXISTS "projection_set_publication_members_document_idx" ON "projection_set_publication_members" USING btree (tenant_id, knowledge_space_id, publication_id, document_asset_id, component_type, component_key);
CREATE INDEX IF NOT EXISTS "projection_set_publication_members_generation_idx" ON "projection_set_publication_members" USING btree (tenant_id, knowledge_space_id, generation_id, publication_id, component_type, component_key);

-- page_index_manifests (platform migration 0008)
CREATE TABLE IF NOT EXISTS "page_index_manifests" (
  "id" UUID NOT NULL,
  "checksum" VARCHAR(64) NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "document_outline_id" UUID NOT NULL,
  "document_version" INTEGER NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "node_count" INTEGER NOT NULL,
  "publication_generation_id" UUID NOT NULL,
  "status" VARCHAR(16) NOT NULL,
  "term_count" INTEGER NOT NULL,
  "tokenizer_version" VARCHAR(64) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "page_index_manifests_pkey" PRIMARY KEY (id),
  CONSTRAINT "page_index_manifests_counts_ck" CHECK (((node_count >= 0) AND (term_count >= 0))),
  CONSTRAINT "page_index_manifests_generation_nonzero_ck" CHECK ((publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid)),
  CONSTRAINT "page_index_manifests_status_ck" CHECK ((status IN ('building', 'ready'))),
  CONSTRAINT "page_index_manifests_outline_fk" FOREIGN KEY (document_outline_id) REFERENCES document_outlines(id) ON DELETE CASCADE,
  CONSTRAINT "page_index_manifests_space_fk" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "page_index_manifests_document_idx" ON "page_index_manifests" USING btree (document_asset_id, publication_generation_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "page_index_manifests_outline_generation_uq" ON "page_index_manifests" USING btree (knowledge_space_id, document_outline_id, publication_generation_id);
CREATE INDEX IF NOT EXISTS "page_index_manifests_ready_scope_idx" ON "page_index_manifests" USING btree (knowledge_space_id, status, document_outline_id, publication_generation_id, id);

-- page_index_nodes (platform migration 0008)
CREATE TABLE IF NOT EXISTS "page_index_nodes" (
  "id" UUID NOT NULL,
  "end_offset" INTEGER,
  "level" INTEGER NOT NULL,
  "manifest_id" UUID NOT NULL,
  "outline_node_id" VARCHAR(512) NOT NULL,
  "parent_outline_node_id" VARCHAR(512),
  "section_path" JSONB NOT NULL,
  "start_offset" INTEGER,
  "summary" TEXT,
  "title" TEXT NOT NULL,
  "toc_source" VARCHAR(32) NOT NULL,
  "visited_node_ids" JSONB NOT NULL,
  CONSTRAINT "page_index_nodes_pkey" PRIMARY KEY (id),
  CONSTRAINT "page_index_nodes_level_ck" CHECK ((level > 0)),
  CONSTRAINT "page_index_nodes_range_ck" CHECK (((start_offset IS NULL) OR (end_offset IS NULL) OR (end_offset >= start_offset))),
  CONSTRAINT "page_index_nodes_manifest_fk" FOREIGN KEY (manifest_id) REFERENCES page_index_manifests(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "page_index_nodes_manifest_id_idx" ON "page_index_nodes" USING btree (manifest_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "page_index_nodes_manifest_outline_node_uq" ON "page_index_nodes" USING btree (manifest_id, outline_node_id);

-- page_index_terms (platform migration 0008)
CREATE TABLE IF NOT EXISTS "page_index_terms" (
  "id" UUID NOT NULL,
  "field_mask" INTEGER NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "manifest_id" UUID NOT NULL,
  "page_index_node_id" UUID NOT NULL,
  "term" VARCHAR(128) NOT NULL,
  CONSTRAINT "page_index_terms_pkey" PRIMARY KEY (id),
  CONSTRAINT "page_index_terms_field_mask_ck" CHECK (((field_mask >= 1) AND (field_mask <= 7))),
  CONSTRAINT "page_index_terms_manifest_fk" FOREIGN KEY (manifest_id) REFERENCES page_index_manifests(id) ON DELETE CASCADE,
  CONSTRAINT "page_index_terms_node_fk" FOREIGN KEY (page_index_node_id) REFERENCES page_index_nodes(id) ON DELETE CASCADE,
  CONSTRAINT "page_index_terms_space_fk" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "page_index_terms_exact_lookup_idx" ON "page_index_terms" USING btree (knowledge_space_id, term, page_index_node_id, manifest_id, field_mask);
CREATE INDEX IF NOT EXISTS "page_index_terms_manifest_lookup_idx" ON "page_index_terms" USING btree (knowledge_space_id, manifest_id, term, page_index_node_id, field_mask);
CREATE UNIQUE INDEX IF NOT EXISTS "page_index_terms_manifest_node_term_uq" ON "page_index_terms" USING btree (manifest_id, page_index_node_id, term);

-- page_index_upgrade_backfills (platform migration 0010)
CREATE TABLE IF NOT EXISTS "page_index_upgrade_backfills" (
  "id" UUID NOT NULL,
  "completed_at" TIMESTAMPTZ,
  "completed_items" INTEGER NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "head_revision" INTEGER NOT NULL,
  "heartbeat_at" TIMESTAMPTZ,
  "knowledge_space_id" UUID NOT NULL,
  "last_error_code" VARCHAR(64),
  "last_error_message" TEXT,
  "lease_expires_at" TIMESTAMPTZ,
  "lease_token" UUID,
  "publication_fingerprint" VARCHAR(86) NOT NULL,
  "publication_id" UUID NOT NULL,
  "retry_count" INTEGER NOT NULL,
  "row_version" INTEGER NOT NULL,
  "run_state" VARCHAR(16) NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "total_items" INTEGER NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "worker_id" VARCHAR(255),
  CONSTRAINT "page_index_upgrade_backfills_pkey" PRIMARY KEY (id),
  CONSTRAINT "page_index_upgrade_backfills_counts_ck" CHECK (((total_items >= 0) AND (completed_items >= 0) AND (completed_items <= total_items))),
  CONSTRAINT "page_index_upgrade_backfills_lease_ck" CHECK (((((run_state)::text = 'running'::text) AND (worker_id IS NOT NULL) AND (lease_token IS NOT NULL) AND (lease_expires_at IS NOT NULL) AND (heartbeat_at IS NOT NULL) AND (completed_at IS NULL)) OR (((run_state)::text <> 'running'::text) AND (worker_id IS NULL) AND (lease_token IS NULL) AND (lease_expires_at IS NULL) AND (heartbeat_at IS NULL)))),
  CONSTRAINT "page_index_upgrade_backfills_lease_token_ck" CHECK (((lease_token IS NULL) OR (lease_token <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "page_index_upgrade_backfills_retry_ck" CHECK ((retry_count >= 0)),
  CONSTRAINT "page_index_upgrade_backfills_revision_ck" CHECK ((head_revision > 0)),
  CONSTRAINT "page_index_upgrade_backfills_row_version_ck" CHECK ((row_version >= 0)),
  CONSTRAINT "page_index_upgrade_backfills_state_ck" CHECK ((run_state IN ('queued', 'running', 'succeeded', 'failed', 'superseded'))),
  CONSTRAINT "page_index_upgrade_backfills_terminal_ck" CHECK ((((run_state IN ('succeeded', 'failed', 'superseded')) AND (completed_at IS NOT NULL)) OR ((run_state IN ('queued', 'running')) AND (completed_at IS NULL)))),
  CONSTRAINT "page_index_upgrade_backfills_tenant_id_knowledge_space_id__fkey" FOREIGN KEY (tenant_id, knowledge_space_id, publication_id, publication_fingerprint) REFERENCES projection_set_publications(tenant_id, knowledge_space_id, id, fingerprint) ON DELETE RESTRICT,
  CONSTRAINT "page_index_upgrade_backfills_tenant_id_knowledge_space_id_fkey" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "page_index_upgrade_backfills_claim_idx" ON "page_index_upgrade_backfills" USING btree (run_state, lease_expires_at, updated_at, id);
CREATE UNIQUE INDEX IF NOT EXISTS "page_index_upgrade_backfills_publication_uq" ON "page_index_upgrade_backfills" USING btree (tenant_id, knowledge_space_id, publication_id);
CREATE INDEX IF NOT EXISTS "page_index_upgrade_backfills_scope_idx" ON "page_index_upgrade_backfills" USING btree (tenant_id, knowledge_space_id, head_revision, updated_at, id);

-- page_index_upgrade_backfill_items (platform migration 0010)
CREATE TABLE IF NOT EXISTS "page_index_upgrade_backfill_items" (
  "backfill_id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "document_asset_id" UUID NOT NULL,
  "document_outline_id" UUID NOT NULL,
  "document_version" INTEGER NOT NULL,
  "ordinal" INTEGER NOT NULL,
  "publication_generation_id" UUID NOT NULL,
  "status" VARCHAR(16) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "page_index_upgrade_backfill_items_pkey" PRIMARY KEY (backfill_id, document_outline_id),
  CONSTRAINT "page_index_upgrade_items_generation_ck" CHECK ((publication_generation_id <> '00000000-0000-0000-0000-000000000000'::uuid)),
  CONSTRAINT "page_index_upgrade_items_ordinal_ck" CHECK ((ordinal >= 0)),
  CONSTRAINT "page_index_upgrade_items_status_ck" CHECK ((status IN ('pending', 'succeeded'))),
  CONSTRAINT "page_index_upgrade_items_version_ck" CHECK ((document_version > 0)),
  CONSTRAINT "page_index_upgrade_backfill_items_backfill_id_fkey" FOREIGN KEY (backfill_id) REFERENCES page_index_upgrade_backfills(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "page_index_upgrade_items_next_idx" ON "page_index_upgrade_backfill_items" USING btree (backfill_id, status, ordinal, document_outline_id);
CREATE UNIQUE INDEX IF NOT EXISTS "page_index_upgrade_items_ordinal_uq" ON "page_index_upgrade_backfill_items" USING btree (backfill_id, ordinal);

-- index_projection_fts_postings (platform migration 0011)
CREATE TABLE IF NOT EXISTS "index_projection_fts_postings" (
  "id" UUID NOT NULL,
  "document_token_count" INTEGER NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "projection_id" UUID NOT NULL,
  "term" VARCHAR(128) NOT NULL,
  "term_frequency" INTEGER NOT NULL,
  "term_hash" CHAR(64) NOT NULL,
  "tokenizer_version" VARCHAR(64) NOT NULL,
  CONSTRAINT "index_projection_fts_postings_pkey" PRIMARY KEY (id),
  CONSTRAINT "index_projection_fts_postings_frequency_ck" CHECK (((term_frequency > 0) AND (document_token_count >= term_frequency))),
  CONSTRAINT "index_projection_fts_postings_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "index_projection_fts_postings_knowledge_space_id_projectio_fkey" FOREIGN KEY (knowledge_space_id, projection_id) REFERENCES index_projections(knowledge_space_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "index_projection_fts_postings_lookup_idx" ON "index_projection_fts_postings" USING btree (knowledge_space_id, term_hash, projection_id);
CREATE UNIQUE INDEX IF NOT EXISTS "index_projection_fts_postings_projection_term_uq" ON "index_projection_fts_postings" USING btree (projection_id, tokenizer_version, term_hash);

-- tidb_fts_posting_backfills (platform migration 0011)
CREATE TABLE IF NOT EXISTS "tidb_fts_posting_backfills" (
  "id" UUID NOT NULL,
  "completed_at" TIMESTAMPTZ,
  "created_at" TIMESTAMPTZ NOT NULL,
  "cursor_projection_id" UUID,
  "heartbeat_at" TIMESTAMPTZ,
  "knowledge_space_id" UUID NOT NULL,
  "last_error_code" VARCHAR(64),
  "last_error_message" TEXT,
  "lease_expires_at" TIMESTAMPTZ,
  "lease_token" UUID,
  "retry_count" INTEGER NOT NULL,
  "row_version" INTEGER NOT NULL,
  "run_state" VARCHAR(16) NOT NULL,
  "scanned_projections" INTEGER NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "tokenizer_version" VARCHAR(64) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "worker_id" VARCHAR(255),
  "written_postings" INTEGER NOT NULL,
  CONSTRAINT "tidb_fts_posting_backfills_pkey" PRIMARY KEY (id),
  CONSTRAINT "tidb_fts_posting_backfills_counts_ck" CHECK (((scanned_projections >= 0) AND (written_postings >= 0) AND (retry_count >= 0) AND (row_version >= 0))),
  CONSTRAINT "tidb_fts_posting_backfills_lease_ck" CHECK (((((run_state)::text = 'running'::text) AND (worker_id IS NOT NULL) AND (lease_token IS NOT NULL) AND (lease_expires_at IS NOT NULL) AND (heartbeat_at IS NOT NULL) AND (completed_at IS NULL)) OR (((run_state)::text <> 'running'::text) AND (worker_id IS NULL) AND (lease_token IS NULL) AND (lease_expires_at IS NULL) AND (heartbeat_at IS NULL)))),
  CONSTRAINT "tidb_fts_posting_backfills_lease_token_ck" CHECK (((lease_token IS NULL) OR (lease_token <> '00000000-0000-0000-0000-000000000000'::uuid))),
  CONSTRAINT "tidb_fts_posting_backfills_state_ck" CHECK ((run_state IN ('queued', 'running', 'succeeded', 'failed'))),
  CONSTRAINT "tidb_fts_posting_backfills_terminal_ck" CHECK ((((run_state IN ('succeeded', 'failed')) AND (completed_at IS NOT NULL)) OR ((run_state IN ('queued', 'running')) AND (completed_at IS NULL)))),
  CONSTRAINT "tidb_fts_posting_backfills_tenant_id_knowledge_space_id_fkey" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "tidb_fts_posting_backfills_claim_idx" ON "tidb_fts_posting_backfills" USING btree (run_state, lease_expires_at, updated_at, id);
CREATE INDEX IF NOT EXISTS "tidb_fts_posting_backfills_scope_idx" ON "tidb_fts_posting_backfills" USING btree (tenant_id, knowledge_space_id, tokenizer_version, id);
CREATE UNIQUE INDEX IF NOT EXISTS "tidb_fts_posting_backfills_space_tokenizer_uq" ON "tidb_fts_posting_backfills" USING btree (tenant_id, knowledge_space_id, tokenizer_version);

-- knowledge_space_members (platform migration 0013)
CREATE TABLE IF NOT EXISTS "knowledge_space_members" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "created_by_subject_id" VARCHAR(255) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "revision" INTEGER NOT NULL,
  "role" VARCHAR(16) NOT NULL,
  "subject_id" VARCHAR(255) NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_members_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_members_revision_ck" CHECK ((revision >= 1)),
  CONSTRAINT "knowledge_space_members_role_ck" CHECK ((role IN ('owner', 'editor', 'viewer'))),
  CONSTRAINT "knowledge_space_members_space_fk" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "knowledge_space_members_scope_role_idx" ON "knowledge_space_members" USING btree (tenant_id, knowledge_space_id, role, subject_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_members_scope_subject_uq" ON "knowledge_space_members" USING btree (tenant_id, knowledge_space_id, subject_id);

-- knowledge_space_access_policies (platform migration 0013)
CREATE TABLE IF NOT EXISTS "knowledge_space_access_policies" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "owner_subject_id" VARCHAR(255) NOT NULL,
  "revision" INTEGER NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "updated_by_subject_id" VARCHAR(255) NOT NULL,
  "visibility" VARCHAR(24) NOT NULL,
  CONSTRAINT "knowledge_space_access_policies_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_access_policies_revision_ck" CHECK ((revision >= 1)),
  CONSTRAINT "knowledge_space_access_policies_visibility_ck" CHECK ((visibility IN ('only_me', 'all_members', 'partial_members'))),
  CONSTRAINT "knowledge_space_access_policies_owner_fk" FOREIGN KEY (tenant_id, knowledge_space_id, owner_subject_id) REFERENCES knowledge_space_members(tenant_id, knowledge_space_id, subject_id) ON DELETE RESTRICT,
  CONSTRAINT "knowledge_space_access_policies_space_fk" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_access_policies_scope_id_uq" ON "knowledge_space_access_policies" USING btree (tenant_id, knowledge_space_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_access_policies_scope_uq" ON "knowledge_space_access_policies" USING btree (tenant_id, knowledge_space_id);

-- knowledge_space_access_policy_members (platform migration 0013)
CREATE TABLE IF NOT EXISTS "knowledge_space_access_policy_members" (
  "id" UUID NOT NULL,
  "access_policy_id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "subject_id" VARCHAR(255) NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  CONSTRAINT "knowledge_space_access_policy_members_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_access_policy_members_member_fk" FOREIGN KEY (tenant_id, knowledge_space_id, subject_id) REFERENCES knowledge_space_members(tenant_id, knowledge_space_id, subject_id) ON DELETE CASCADE,
  CONSTRAINT "knowledge_space_access_policy_members_policy_fk" FOREIGN KEY (tenant_id, knowledge_space_id, access_policy_id) REFERENCES knowledge_space_access_policies(tenant_id, knowledge_space_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_access_policy_members_policy_subject_uq" ON "knowledge_space_access_policy_members" USING btree (access_policy_id, subject_id);
CREATE INDEX IF NOT EXISTS "knowledge_space_access_policy_members_scope_subject_idx" ON "knowledge_space_access_policy_members" USING btree (tenant_id, knowledge_space_id, subject_id, access_policy_id);

-- knowledge_space_api_access (platform migration 0013)
CREATE TABLE IF NOT EXISTS "knowledge_space_api_access" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "disabled_at" TIMESTAMPTZ,
  "enabled" BOOLEAN NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "revision" INTEGER NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "updated_by_subject_id" VARCHAR(255) NOT NULL,
  CONSTRAINT "knowledge_space_api_access_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_api_access_disabled_ck" CHECK (((enabled AND (disabled_at IS NULL)) OR ((NOT enabled) AND (disabled_at IS NOT NULL)))),
  CONSTRAINT "knowledge_space_api_access_revision_ck" CHECK ((revision >= 1)),
  CONSTRAINT "knowledge_space_api_access_space_fk" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_api_access_scope_uq" ON "knowledge_space_api_access" USING btree (tenant_id, knowledge_space_id);

-- knowledge_space_api_keys (platform migration 0013)
CREATE TABLE IF NOT EXISTS "knowledge_space_api_keys" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "created_by_subject_id" VARCHAR(255) NOT NULL,
  "expires_at" TIMESTAMPTZ,
  "key_hash" VARCHAR(64) NOT NULL,
  "key_prefix" VARCHAR(24) NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "last_used_at" TIMESTAMPTZ,
  "name" VARCHAR(160) NOT NULL,
  "principal_subject_id" VARCHAR(255) NOT NULL,
  "revision" INTEGER NOT NULL,
  "revoked_at" TIMESTAMPTZ,
  "status" VARCHAR(16) NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "knowledge_space_api_keys_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_api_keys_revision_ck" CHECK ((revision >= 1)),
  CONSTRAINT "knowledge_space_api_keys_revocation_ck" CHECK (((((status)::text = 'active'::text) AND (revoked_at IS NULL)) OR (((status)::text = 'revoked'::text) AND (revoked_at IS NOT NULL)))),
  CONSTRAINT "knowledge_space_api_keys_status_ck" CHECK ((status IN ('active', 'revoked'))),
  CONSTRAINT "knowledge_space_api_keys_principal_fk" FOREIGN KEY (tenant_id, knowledge_space_id, principal_subject_id) REFERENCES knowledge_space_members(tenant_id, knowledge_space_id, subject_id) ON DELETE CASCADE,
  CONSTRAINT "knowledge_space_api_keys_space_fk" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_api_keys_hash_uq" ON "knowledge_space_api_keys" USING btree (key_hash);
CREATE INDEX IF NOT EXISTS "knowledge_space_api_keys_scope_created_idx" ON "knowledge_space_api_keys" USING btree (tenant_id, knowledge_space_id, created_at, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_api_keys_scope_id_uq" ON "knowledge_space_api_keys" USING btree (tenant_id, knowledge_space_id, id);
CREATE INDEX IF NOT EXISTS "knowledge_space_api_keys_scope_status_idx" ON "knowledge_space_api_keys" USING btree (tenant_id, knowledge_space_id, status, created_at, id);

-- knowledge_space_permission_snapshots (platform migration 0013)
CREATE TABLE IF NOT EXISTS "knowledge_space_permission_snapshots" (
  "id" UUID NOT NULL,
  "access_channel" VARCHAR(16) NOT NULL,
  "access_policy_revision" INTEGER NOT NULL,
  "api_access_revision" INTEGER NOT NULL,
  "api_key_expires_at" TIMESTAMPTZ,
  "api_key_id" UUID,
  "api_key_revision" INTEGER,
  "created_at" TIMESTAMPTZ NOT NULL,
  "expires_at" TIMESTAMPTZ NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "member_revision" INTEGER NOT NULL,
  "permission_scopes" JSONB NOT NULL,
  "revision" INTEGER NOT NULL,
  "revoked_at" TIMESTAMPTZ,
  "role" VARCHAR(16) NOT NULL,
  "status" VARCHAR(16) NOT NULL,
  "subject_id" VARCHAR(255) NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "visibility" VARCHAR(24) NOT NULL,
  CONSTRAINT "knowledge_space_permission_snapshots_pkey" PRIMARY KEY (id),
  CONSTRAINT "knowledge_space_permission_snapshots_api_key_binding_ck" CHECK ((((api_key_id IS NULL) AND (api_key_revision IS NULL) AND (api_key_expires_at IS NULL)) OR ((api_key_id IS NOT NULL) AND (api_key_revision >= 1)))),
  CONSTRAINT "knowledge_space_permission_snapshots_channel_ck" CHECK ((access_channel IN ('interactive', 'service_api', 'mcp', 'agent'))),
  CONSTRAINT "knowledge_space_permission_snapshots_revisions_ck" CHECK (((revision >= 1) AND (member_revision >= 1) AND (access_policy_revision >= 1) AND (api_access_revision >= 1))),
  CONSTRAINT "knowledge_space_permission_snapshots_revocation_ck" CHECK (((((status)::text = 'revoked'::text) AND (revoked_at IS NOT NULL)) OR (((status)::text <> 'revoked'::text) AND (revoked_at IS NULL)))),
  CONSTRAINT "knowledge_space_permission_snapshots_role_ck" CHECK ((role IN ('owner', 'editor', 'viewer'))),
  CONSTRAINT "knowledge_space_permission_snapshots_status_ck" CHECK ((status IN ('active', 'revoked', 'expired'))),
  CONSTRAINT "knowledge_space_permission_snapshots_visibility_ck" CHECK ((visibility IN ('only_me', 'all_members', 'partial_members'))),
  CONSTRAINT "knowledge_space_permission_snapshots_api_key_fk" FOREIGN KEY (tenant_id, knowledge_space_id, api_key_id) REFERENCES knowledge_space_api_keys(tenant_id, knowledge_space_id, id) ON DELETE RESTRICT,
  CONSTRAINT "knowledge_space_permission_snapshots_space_fk" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "knowledge_space_permission_snapshots_api_key_idx" ON "knowledge_space_permission_snapshots" USING btree (tenant_id, knowledge_space_id, api_key_id, api_key_revision);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_permission_snapshots_provenance_uq" ON "knowledge_space_permission_snapshots" USING btree (tenant_id, knowledge_space_id, id, subject_id, access_channel);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_permission_snapshots_scope_id_uq" ON "knowledge_space_permission_snapshots" USING btree (tenant_id, knowledge_space_id, id);
CREATE INDEX IF NOT EXISTS "knowledge_space_permission_snapshots_scope_subject_idx" ON "knowledge_space_permission_snapshots" USING btree (tenant_id, knowledge_space_id, subject_id, status, expires_at, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_permission_snapshots_space_id_uq" ON "knowledge_space_permission_snapshots" USING btree (knowledge_space_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "knowledge_space_permission_snapshots_trace_provenance_uq" ON "knowledge_space_permission_snapshots" USING btree (knowledge_space_id, id, subject_id, access_channel);

-- answer_traces (platform migration 0001)
CREATE TABLE IF NOT EXISTS "answer_traces" (
  "id" UUID NOT NULL,
  "access_channel" VARCHAR(16),
  "completed" BOOLEAN NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "evidence_bundle_id" UUID,
  "knowledge_space_id" UUID NOT NULL,
  "mode" TEXT NOT NULL,
  "permission_snapshot_id" UUID,
  "permission_snapshot_revision" INTEGER,
  "query" TEXT NOT NULL,
  "subject_id" VARCHAR(255),
  CONSTRAINT "answer_traces_pkey" PRIMARY KEY (id),
  CONSTRAINT "answer_traces_permission_snapshot_binding_ck" CHECK ((((permission_snapshot_id IS NULL) AND (permission_snapshot_revision IS NULL) AND (access_channel IS NULL)) OR ((subject_id IS NOT NULL) AND (permission_snapshot_id IS NOT NULL) AND (permission_snapshot_revision >= 1) AND (access_channel IN ('interactive', 'service_api', 'mcp', 'agent'))))),
  CONSTRAINT "answer_traces_evidence_bundle_id_fkey" FOREIGN KEY (evidence_bundle_id) REFERENCES evidence_bundles(id) ON DELETE SET NULL,
  CONSTRAINT "answer_traces_knowledge_space_id_fkey" FOREIGN KEY (knowledge_space_id) REFERENCES knowledge_spaces(id) ON DELETE CASCADE,
  CONSTRAINT "answer_traces_permission_snapshot_fk" FOREIGN KEY (knowledge_space_id, permission_snapshot_id, subject_id, access_channel) REFERENCES knowledge_space_permission_snapshots(knowledge_space_id, id, subject_id, access_channel) ON DELETE RESTRICT
);
CREATE INDEX IF NOT EXISTS "answer_traces_bundle_idx" ON "answer_traces" USING btree (evidence_bundle_id);
CREATE INDEX IF NOT EXISTS "answer_traces_space_created_idx" ON "answer_traces" USING btree (knowledge_space_id, created_at, id);
CREATE INDEX IF NOT EXISTS "answer_traces_space_subject_created_idx" ON "answer_traces" USING btree (knowledge_space_id, subject_id, created_at, id);

-- answer_trace_steps (platform migration 0001)
CREATE TABLE IF NOT EXISTS "answer_trace_steps" (
  "id" UUID NOT NULL,
  "ended_at" TIMESTAMPTZ NOT NULL,
  "metadata" JSONB NOT NULL,
  "name" TEXT NOT NULL,
  "started_at" TIMESTAMPTZ NOT NULL,
  "status" TEXT NOT NULL,
  "trace_id" UUID NOT NULL,
  "updated_at" TIMESTAMPTZ,
  CONSTRAINT "answer_trace_steps_pkey" PRIMARY KEY (id),
  CONSTRAINT "answer_trace_steps_trace_id_fkey" FOREIGN KEY (trace_id) REFERENCES answer_traces(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS "answer_trace_steps_trace_started_idx" ON "answer_trace_steps" USING btree (trace_id, started_at, id);

-- source_credential_backfills (platform migration 0014)
CREATE TABLE IF NOT EXISTS "source_credential_backfills" (
  "id" UUID NOT NULL,
  "candidate_credential_ref" TEXT NOT NULL,
  "completed_at" TIMESTAMPTZ,
  "created_at" TIMESTAMPTZ NOT NULL,
  "heartbeat_at" TIMESTAMPTZ,
  "knowledge_space_id" UUID NOT NULL,
  "last_error_code" TEXT,
  "last_error_message" TEXT,
  "lease_expires_at" TIMESTAMPTZ,
  "lease_token" UUID,
  "retry_count" INTEGER NOT NULL,
  "row_version" INTEGER NOT NULL,
  "run_state" TEXT NOT NULL,
  "secret_fingerprint" CHAR(64) NOT NULL,
  "source_id" UUID NOT NULL,
  "source_version" INTEGER NOT NULL,
  "tenant_id" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "worker_id" TEXT,
  CONSTRAINT "source_credential_backfills_pkey" PRIMARY KEY (id),
  CONSTRAINT "source_credential_backfills_counts_ck" CHECK (((retry_count >= 0) AND (row_version >= 0))),
  CONSTRAINT "source_credential_backfills_lease_ck" CHECK ((((run_state = 'running'::text) AND (worker_id IS NOT NULL) AND (lease_token IS NOT NULL) AND (lease_expires_at IS NOT NULL) AND (heartbeat_at IS NOT NULL) AND (completed_at IS NULL)) OR ((run_state <> 'running'::text) AND (worker_id IS NULL) AND (lease_token IS NULL) AND (lease_expires_at IS NULL) AND (heartbeat_at IS NULL)))),
  CONSTRAINT "source_credential_backfills_source_version_ck" CHECK ((source_version >= 1)),
  CONSTRAINT "source_credential_backfills_state_ck" CHECK ((run_state = ANY (ARRAY['queued'::text, 'running'::text, 'succeeded'::text, 'failed'::text]))),
  CONSTRAINT "source_credential_backfills_terminal_ck" CHECK ((((run_state = ANY (ARRAY['succeeded'::text, 'failed'::text])) AND (completed_at IS NOT NULL)) OR ((run_state = ANY (ARRAY['queued'::text, 'running'::text])) AND (completed_at IS NULL)))),
  CONSTRAINT "source_credential_backfills_knowledge_space_id_source_id_fkey" FOREIGN KEY (knowledge_space_id, source_id) REFERENCES sources(knowledge_space_id, id) ON DELETE CASCADE,
  CONSTRAINT "source_credential_backfills_tenant_id_knowledge_space_id_fkey" FOREIGN KEY (tenant_id, knowledge_space_id) REFERENCES knowledge_spaces(tenant_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS "source_credential_backfills_candidate_ref_uq" ON "source_credential_backfills" USING btree (candidate_credential_ref);
CREATE INDEX IF NOT EXISTS "source_credential_backfills_claim_idx" ON "source_credential_backfills" USING btree (run_state, lease_expires_at, updated_at, id);
CREATE INDEX IF NOT EXISTS "source_credential_backfills_scope_idx" ON "source_credential_backfills" USING btree (tenant_id, knowledge_space_id, source_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS "source_credential_backfills_source_uq" ON "source_credential_backfills" USING btree (tenant_id, knowledge_space_id, source_id);

-- source_secret_lifecycle_refs (platform migration 0014)
CREATE TABLE IF NOT EXISTS "source_secret_lifecycle_refs" (
  "id" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "credential_ref" TEXT NOT NULL,
  "delete_attempts" INTEGER NOT NULL,
  "deleted_at" TIMESTAMPTZ,
  "heartbeat_at" TIMESTAMPTZ,
  "knowledge_space_id" UUID NOT NULL,
  "last_error_code" TEXT,
  "last_error_message" TEXT,
  "lease_expires_at" TIMESTAMPTZ,
  "lease_token" UUID,
  "next_delete_at" TIMESTAMPTZ,
  "operation_id" TEXT NOT NULL,
  "purpose" TEXT NOT NULL,
  "recover_after" TIMESTAMPTZ NOT NULL,
  "row_version" INTEGER NOT NULL,
  "source_id" UUID NOT NULL,
  "source_version" INTEGER,
  "state" TEXT NOT NULL,
  "tenant_id" TEXT NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "worker_id" TEXT,
  CONSTRAINT "source_secret_lifecycle_refs_pkey" PRIMARY KEY (id),
  CONSTRAINT "source_secret_lifecycle_refs_counts_ck" CHECK (((delete_attempts >= 0) AND (row_version >= 0))),
  CONSTRAINT "source_secret_lifecycle_refs_lease_ck" CHECK ((((state = 'deleting'::text) AND (worker_id IS NOT NULL) AND (lease_token IS NOT NULL) AND (lease_expires_at IS NOT NULL) AND (heartbeat_at IS NOT NULL) AND (deleted_at IS NULL)) OR ((state <> 'deleting'::text) AND (worker_id IS NULL) AND (lease_token IS NULL) AND (lease_expires_at IS NULL) AND (heartbeat_at IS NULL)))),
  CONSTRAINT "source_secret_lifecycle_refs_purpose_ck" CHECK ((purpose = ANY (ARRAY['create'::text, 'rotate'::text, 'backfill'::text]))),
  CONSTRAINT "source_secret_lifecycle_refs_source_version_ck" CHECK (((source_version IS NULL) OR (source_version >= 1))),
  CONSTRAINT "source_secret_lifecycle_refs_state_ck" CHECK ((state = ANY (ARRAY['staged'::text, 'candidate'::text, 'active'::text, 'retired'::text, 'deleting'::text, 'deleted'::text]))),
  CONSTRAINT "source_secret_lifecycle_refs_terminal_ck" CHECK ((((state = 'deleted'::text) AND (deleted_at IS NOT NULL)) OR ((state <> 'deleted'::text) AND (deleted_at IS NULL))))
);
CREATE INDEX IF NOT EXISTS "source_secret_lifecycle_refs_claim_idx" ON "source_secret_lifecycle_refs" USING btree (state, next_delete_at, lease_expires_at, updated_at, id);
CREATE INDEX IF NOT EXISTS "source_secret_lifecycle_refs_operation_idx" ON "source_secret_lifecycle_refs" USING btree (operation_id, state, id);
CREATE INDEX IF NOT EXISTS "source_secret_lifecycle_refs_recovery_idx" ON "source_secret_lifecycle_refs" USING btree (state, recover_after, id);
CREATE UNIQUE INDEX IF NOT EXISTS "source_secret_lifecycle_refs_ref_uq" ON "source_secret_lifecycle_refs" USING btree (credential_ref);
CREATE INDEX IF NOT EXISTS "source_secret_lifecycle_refs_scope_idx" ON "source_secret_lifecycle_refs" USING btree (tenant_id, knowledge_space_id, source_id, id);
