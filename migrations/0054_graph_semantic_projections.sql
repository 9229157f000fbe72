-- kfs-worker migration 0054: the platform's 0054_graph_semantic_projections.
-- Semantic (vector) projections of graph entities and relations, one per owner and vector space.
-- Additive: publications without them stay readable. The vector column is pgvector's vector with
-- no fixed dimension (the row's dimension column says it); rows go with their owner or space.

CREATE TABLE IF NOT EXISTS "graph_entity_semantic_projections" (
  "owner_id" UUID NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "publication_generation_id" UUID NOT NULL,
  "vector_space_id" VARCHAR(87) NOT NULL,
  "dimension" INTEGER NOT NULL,
  "representation_version" VARCHAR(64) NOT NULL,
  "content_hash" CHAR(64) NOT NULL,
  "search_text" TEXT NOT NULL,
  "vector" vector NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "graph_entity_semantic_projections_pkey" PRIMARY KEY ("owner_id", "vector_space_id"),
  CONSTRAINT "graph_entity_semantic_projections_owner_id_fkey"
    FOREIGN KEY ("owner_id") REFERENCES "graph_entities" ("id") ON DELETE CASCADE,
  CONSTRAINT "graph_entity_semantic_projections_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id") REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

CREATE INDEX IF NOT EXISTS "graph_entity_semantic_scope_idx"
  ON "graph_entity_semantic_projections" (
    "knowledge_space_id", "vector_space_id", "publication_generation_id", "owner_id"
  );

CREATE TABLE IF NOT EXISTS "graph_relation_semantic_projections" (
  "owner_id" UUID NOT NULL,
  "knowledge_space_id" UUID NOT NULL,
  "publication_generation_id" UUID NOT NULL,
  "vector_space_id" VARCHAR(87) NOT NULL,
  "dimension" INTEGER NOT NULL,
  "representation_version" VARCHAR(64) NOT NULL,
  "content_hash" CHAR(64) NOT NULL,
  "search_text" TEXT NOT NULL,
  "vector" vector NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "graph_relation_semantic_projections_pkey" PRIMARY KEY ("owner_id", "vector_space_id"),
  CONSTRAINT "graph_relation_semantic_projections_owner_id_fkey"
    FOREIGN KEY ("owner_id") REFERENCES "graph_relations" ("id") ON DELETE CASCADE,
  CONSTRAINT "graph_relation_semantic_projections_knowledge_space_id_fkey"
    FOREIGN KEY ("knowledge_space_id") REFERENCES "knowledge_spaces" ("id") ON DELETE CASCADE
);

CREATE INDEX IF NOT EXISTS "graph_relation_semantic_scope_idx"
  ON "graph_relation_semantic_projections" (
    "knowledge_space_id", "vector_space_id", "publication_generation_id", "owner_id"
  );

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0054_graph_semantic_projections', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
