//! Each supported format (Markdown, HTML, plain text) is compiled, published and searchable, and
//! bad input fails with a clear code, frees the slot and publishes nothing.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_format_is_compiled_published_and_searchable() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-formats", 64);
    let docs = [
        (
            "guide.md",
            "text/markdown",
            GUIDE_MD,
            "zeppelin mooring",
            "superheat",
        ),
        (
            "page.html",
            "text/html; charset=utf-8",
            PAGE_HTML,
            "fresnel lens",
            "diaphones",
        ),
        (
            "notes.txt",
            "text/plain",
            NOTES_TXT,
            "varroa mites",
            "carniolan",
        ),
    ];
    let mut revision = 0;
    for (name, mime, bytes, query, word) in docs {
        let doc = fx.add(name, mime, bytes).await;
        let attempt = fx.request(doc, false).await.unwrap();
        let created = fx.status(attempt).await;
        assert_eq!(
            (
                created.run_state.as_str(),
                created.checkpoint.as_str(),
                created.active_slot,
                created.row_version,
                created.execution_attempts,
                created.max_execution_attempts,
                created.base_head_revision,
            ),
            ("dispatch_pending", "queued", Some(1), 0, 0, 5, revision)
        );
        assert_eq!(created.tenant_id, TENANT);
        assert_ne!(created.publication_generation_id, Uuid::nil());
        let (payload, key, event, schema, dispatch_attempts): (
            serde_json::Value,
            String,
            String,
            i32,
            i32,
        ) = sqlx::query_as(
            "SELECT payload, idempotency_key, event_type, schema_version, dispatch_attempts \
                 FROM document_compilation_outbox WHERE attempt_id = $1",
        )
        .bind(attempt)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(
            payload,
            serde_json::json!({ "attemptId": attempt.to_string() })
        );
        assert_eq!(key, format!("document.compile:{attempt}"));
        assert_eq!(
            (event.as_str(), schema, dispatch_attempts),
            ("document.compile", 1, 0)
        );

        let done = fx.drive(&engine, attempt).await;
        assert_succeeded(&done);
        revision += 1;
        let head = fx.head().await.unwrap();
        assert_eq!(head.revision, revision);
        assert_eq!(head.status, "published");
        assert_eq!(
            Some(head.publication_id),
            done.candidate_publication_id,
            "the attempt's own candidate is what the head publishes"
        );
        let served = fx.served().await;
        assert_eq!(served[&doc].generation, done.publication_generation_id);
        assert_eq!(served[&doc].version, 1);

        let expected = expected_nodes(mime, name, bytes);
        assert!(expected >= 1, "{name}");
        assert_eq!(fx.served_nodes(doc).await, expected, "{name}");
        let g = done.publication_generation_id;
        assert_eq!(fx.rows_of_generation("knowledge_nodes", g).await, expected);
        assert_eq!(
            fx.rows_of_generation("index_projections", g).await,
            expected,
            "one fts projection per node, no dense one without an embedding profile"
        );
        assert_eq!(fx.rows_of_generation("document_outlines", g).await, 1);
        assert_eq!(
            fx.rows_of_generation("document_multimodal_manifests", g)
                .await,
            1
        );
        assert!(fx.rows_of_generation("knowledge_paths", g).await >= 3);
        let (ready, building): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status = 'ready'), count(*) FILTER (WHERE status <> 'ready') \
             FROM index_projections WHERE publication_generation_id = $1 AND type = 'fts' \
               AND model = 'database-fts@1' AND projection_version = 1 AND fts_document IS NOT NULL",
        )
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!((ready, building), (expected, 0), "promoted at publish");
        let (status, nodes, terms, actual_nodes): (String, i32, i32, i64) = sqlx::query_as(
            "SELECT m.status, m.node_count, m.term_count, (SELECT count(*) FROM page_index_nodes n WHERE n.manifest_id = m.id) \
             FROM page_index_manifests m WHERE m.publication_generation_id = $1",
        )
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(status, "ready");
        assert!(nodes > 0 && terms > 0);
        assert_eq!(i64::from(nodes), actual_nodes);
        let longest: i32 = sqlx::query_scalar(
            "SELECT max(char_length(text)) FROM knowledge_nodes WHERE publication_generation_id = $1",
        )
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert!(longest as usize <= MAX_CHUNK_GRAPHEMES);
        let (parser_status, artifacts): (String, i64) = sqlx::query_as(
            "SELECT d.parser_status, (SELECT count(*) FROM parse_artifacts a WHERE a.document_asset_id = d.id AND a.version = 1) \
             FROM document_assets d WHERE d.id = $1",
        )
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!((parser_status.as_str(), artifacts), ("parsed", 1));

        for q in [query, word] {
            let hits = fx.search(q).await;
            assert!(!hits.is_empty(), "{name}: no hit for {q:?}");
            assert!(
                hits.iter().all(|h| h.document_asset_id == doc),
                "{name}: {hits:?}"
            );
        }
    }
    // Markdown: headings made the outline tree, the long section was split, front matter and
    // code fences kept their place.
    let nodes: serde_json::Value = sqlx::query_scalar(
        "SELECT o.nodes FROM document_outlines o JOIN document_assets d ON d.id = o.document_asset_id \
         WHERE d.filename = 'guide.md'",
    )
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(nodes[0]["title"], "Zeppelin Field Guide");
    assert_eq!(nodes[0]["tocSource"], "parser-heading");
    let h2: Vec<&str> = nodes[0]["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["title"].as_str().unwrap())
        .collect();
    assert_eq!(h2, ["Mooring", "Ballast", "Navigation"]);
    assert_eq!(nodes[0]["children"][1]["children"][0]["title"], "Weigh-off");
    let weigh = fx.search("static heaviness").await;
    assert_eq!(weigh.len(), 1);
    assert_eq!(
        weigh[0].source_location["sectionPath"],
        serde_json::json!(["Zeppelin Field Guide", "Ballast", "Weigh-off"])
    );
    // HTML: scripts and styles are not content.
    assert!(fx.search("telemetry indexed").await.is_empty());
    assert_eq!(fx.served().await.len(), 3, "every document is a member");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_fails_with_a_clear_code_frees_the_slot_and_publishes_nothing() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-bad", 64);

    let corrupt = fx
        .add(
            "broken.md",
            "text/markdown",
            b"# Title\n\nok \xff\xfe bytes",
        )
        .await;
    let mismatched = fx
        .add("tampered.txt", "text/plain", b"original words")
        .await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(mismatched)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store
        .put(&key, Bytes::from_static(b"tampered words"))
        .await
        .unwrap();
    let unsupported = fx.add("photo.bmp", "image/bmp", b"BM6 ...").await;
    let missing = fx.add("gone.txt", "text/plain", b"soon gone").await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(missing)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store.delete(&key).await.unwrap();

    for (doc, code) in [
        (corrupt, "corrupt_document"),
        (mismatched, "hash_mismatch"),
        (unsupported, "unsupported_format"),
        (missing, "object_missing"),
    ] {
        let attempt = fx.request(doc, false).await.unwrap();
        let s = fx.drive(&engine, attempt).await;
        assert_failed(&s, code);
        assert_eq!(s.checkpoint, "queued", "nothing advanced");
        assert!(s
            .last_error_message
            .as_deref()
            .is_some_and(|m| !m.is_empty()));
        assert_eq!(fx.served_nodes(doc).await, 0);
        let parser_status: String =
            sqlx::query_scalar("SELECT parser_status FROM document_assets WHERE id = $1")
                .bind(doc)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        assert_eq!(
            parser_status, "failed",
            "the document records that its bytes failed"
        );
        assert_eq!(
            fx.rows_of_generation("knowledge_nodes", s.publication_generation_id)
                .await,
            0
        );
        // The slot is free: the same version can be requested again.
        let again = fx.request(doc, true).await.unwrap();
        assert_ne!(again, attempt);
    }
    assert!(fx.head().await.is_none(), "nothing was published");
    fx.cleanup().await;
}
