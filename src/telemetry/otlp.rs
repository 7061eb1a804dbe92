//! A small OTLP/HTTP exporter: spans in the protobuf JSON mapping (`resourceSpans` →
//! `scopeSpans` → `spans`, hex ids, times as decimal strings), posted to `{endpoint}/v1/traces`
//! in batches by one background task.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::{Value as Json, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{ExportStats, OtlpConfig, Span, Value};

fn attribute(key: &str, value: &Value) -> Json {
    let value = match value {
        Value::Str(s) => json!({ "stringValue": s }),
        Value::Int(n) => json!({ "intValue": n.to_string() }),
        Value::Bool(b) => json!({ "boolValue": b }),
    };
    json!({ "key": key, "value": value })
}

fn span_json(s: &Span) -> Json {
    let mut v = json!({
        "traceId": hex::encode(s.trace_id),
        "spanId": hex::encode(s.span_id),
        "name": s.name,
        "kind": s.kind as u8,
        "startTimeUnixNano": s.start_ns.to_string(),
        "endTimeUnixNano": s.end_ns.max(s.start_ns).to_string(),
        "attributes": s.attributes.iter().map(|(k, v)| attribute(k, v)).collect::<Vec<_>>(),
        "status": match &s.error {
            Some(message) => json!({ "code": 2, "message": message }),
            None => json!({ "code": 0 }),
        },
    });
    if let Some(p) = s.parent_span_id {
        v["parentSpanId"] = Json::String(hex::encode(p));
    }
    v
}

/// The body of one export request (`ExportTraceServiceRequest`).
pub fn request_body(resource: &[(&'static str, Value)], spans: &[Span]) -> Json {
    json!({
        "resourceSpans": [{
            "resource": {
                "attributes": resource.iter().map(|(k, v)| attribute(k, v)).collect::<Vec<_>>(),
            },
            "scopeSpans": [{
                "scope": { "name": "agentd", "version": env!("CARGO_PKG_VERSION") },
                "spans": spans.iter().map(span_json).collect::<Vec<_>>(),
            }],
        }],
    })
}

/// The exporter task: collects spans from `rx` and posts a batch when it is full or
/// `interval` has passed; on `stop`, sends what is queued and ends.
pub(super) async fn export_loop(
    config: OtlpConfig,
    resource: Vec<(&'static str, Value)>,
    mut rx: mpsc::Receiver<Span>,
    stop: CancellationToken,
    stats: Arc<ExportStats>,
) {
    let url = format!("{}/v1/traces", config.endpoint.trim_end_matches('/'));
    let client = match reqwest::Client::builder()
        .timeout(config.timeout)
        .connect_timeout(config.timeout)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot build the OTLP client; traces are off");
            return;
        }
    };
    let max_batch = config.max_batch.max(1);
    let mut batch: Vec<Span> = Vec::with_capacity(max_batch);
    let mut tick = tokio::time::interval(config.interval.max(std::time::Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            span = rx.recv() => match span {
                Some(span) => {
                    batch.push(span);
                    if batch.len() >= max_batch {
                        send(&client, &url, &resource, &mut batch, &stats).await;
                    }
                }
                None => break,
            },
            _ = tick.tick() => {
                if !batch.is_empty() {
                    send(&client, &url, &resource, &mut batch, &stats).await;
                }
            }
        }
    }
    while let Ok(span) = rx.try_recv() {
        batch.push(span);
        if batch.len() >= max_batch {
            send(&client, &url, &resource, &mut batch, &stats).await;
        }
    }
    if !batch.is_empty() {
        send(&client, &url, &resource, &mut batch, &stats).await;
    }
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    resource: &[(&'static str, Value)],
    batch: &mut Vec<Span>,
    stats: &ExportStats,
) {
    let n = batch.len() as u64;
    let body = request_body(resource, batch);
    batch.clear();
    let outcome = client.post(url).json(&body).send().await;
    match outcome {
        Ok(r) if r.status().is_success() => {
            stats.exported.fetch_add(n, Ordering::Relaxed);
        }
        Ok(r) => {
            tracing::warn!(status = %r.status(), spans = n, "the OTLP collector refused a batch of spans");
            stats.failed_exports.fetch_add(1, Ordering::Relaxed);
            stats.dropped.fetch_add(n, Ordering::Relaxed);
        }
        Err(e) => {
            tracing::warn!(error = %e, spans = n, "could not export a batch of spans");
            stats.failed_exports.fetch_add(1, Ordering::Relaxed);
            stats.dropped.fetch_add(n, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::telemetry::SpanKind;

    #[test]
    fn spans_follow_the_protobuf_json_mapping() {
        let span = Span {
            trace_id: [0xab; 16],
            span_id: [0x01; 8],
            parent_span_id: Some([0x02; 8]),
            name: "chat m".into(),
            kind: SpanKind::Client,
            start_ns: 1_700_000_000_000_000_000,
            end_ns: 1_700_000_000_000_000_500,
            attributes: vec![
                ("gen_ai.request.model", Value::from("m")),
                ("gen_ai.usage.input_tokens", Value::Int(12)),
            ],
            error: Some("unavailable".into()),
        };
        let body = request_body(&[("service.name", Value::from("agentd"))], &[span]);
        let rs = &body["resourceSpans"][0];
        assert_eq!(
            rs["resource"]["attributes"][0],
            json!({"key": "service.name", "value": {"stringValue": "agentd"}})
        );
        let s = &rs["scopeSpans"][0]["spans"][0];
        assert_eq!(s["traceId"], "ab".repeat(16));
        assert_eq!(s["spanId"], "01".repeat(8));
        assert_eq!(s["parentSpanId"], "02".repeat(8));
        assert_eq!(s["kind"], 3);
        assert_eq!(s["startTimeUnixNano"], "1700000000000000000");
        assert_eq!(s["endTimeUnixNano"], "1700000000000000500");
        assert_eq!(
            s["attributes"][1],
            json!({"key": "gen_ai.usage.input_tokens", "value": {"intValue": "12"}})
        );
        assert_eq!(s["status"], json!({"code": 2, "message": "unavailable"}));
    }
}
