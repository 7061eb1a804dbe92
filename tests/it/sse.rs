//! SSE: `id:` = seq, `event:` = type, data = the event JSON; a client that reconnects with
//! `Last-Event-ID` (or `?after=`) gets every later event exactly once; the stream ends with the run.

use std::time::Duration;

use eventsource_stream::{Event, Eventsource};
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::Value;

use crate::daemon_support::{ALPHA, TestDaemon, assert_error};

async fn open(d: &TestDaemon, path: &str, last: Option<&str>) -> reqwest::Response {
    let mut b = d
        .http
        .get(d.url(path))
        .bearer_auth(ALPHA)
        .header("accept", "text/event-stream");
    if let Some(l) = last {
        b = b.header("last-event-id", l);
    }
    let res = b.send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        res.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    res
}

/// Reads up to `n` events (all when `None`) within a deadline.
async fn read(res: reqwest::Response, n: Option<usize>) -> Vec<Event> {
    let mut stream = res.bytes_stream().eventsource();
    let mut out = Vec::new();
    let read = async {
        while let Some(ev) = stream.next().await {
            let ev = ev.unwrap();
            out.push(ev);
            if n.is_some_and(|n| out.len() >= n) {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(15), read)
        .await
        .expect("SSE stream stalled");
    out
}

fn check(ev: &Event) -> Value {
    let data: Value = serde_json::from_str(&ev.data).unwrap();
    assert_eq!(ev.id, data["seq"].to_string());
    assert_eq!(ev.event, data["type"].as_str().unwrap());
    assert!(data["at"].as_str().unwrap().ends_with('Z'));
    data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_with_last_event_id_delivers_each_event_once() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "slow").await;
    let path = format!("/v1/runs/{id}/events");
    let first = read(open(&d, &path, None).await, Some(3)).await;
    assert_eq!(first.len(), 3);
    let last = first.last().unwrap().id.clone();
    assert_eq!(last, "3");
    // Reconnect while the run is still going; the stream ends after the terminal event.
    let rest = read(open(&d, &path, Some(&last)).await, None).await;
    let all: Vec<Value> = first.iter().chain(rest.iter()).map(check).collect();
    let seqs: Vec<u64> = all.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "each event exactly once, in order"
    );
    assert_eq!(all.last().unwrap()["type"], "run_succeeded");
    // The same as the JSON log.
    let (_, log) = d.get(&path, ALPHA).await;
    let logged: Vec<Value> = log["events"].as_array().unwrap().clone();
    assert_eq!(all, logged);

    // `?after=` works like Last-Event-ID, and the header wins over it.
    let tail = read(open(&d, &format!("{path}?after=5"), None).await, None).await;
    assert_eq!(tail.first().unwrap().id, "6");
    let tail = read(open(&d, &format!("{path}?after=1"), Some("5")).await, None).await;
    assert_eq!(tail.first().unwrap().id, "6");
    // Resuming after the terminal event: an empty stream that ends at once.
    let n = logged.len().to_string();
    let none = read(open(&d, &path, Some(&n)).await, None).await;
    assert!(none.is_empty());

    let res = d
        .http
        .get(d.url(&path))
        .bearer_auth(ALPHA)
        .header("accept", "text/event-stream")
        .header("last-event-id", "abc")
        .send()
        .await
        .unwrap();
    let s = res.status();
    assert_error(
        s,
        &res.json().await.unwrap(),
        StatusCode::BAD_REQUEST,
        "invalid_query",
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_open_streams() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "hang").await;
    let res = open(&d, &format!("/v1/runs/{id}/events"), None).await;
    let mut stream = res.bytes_stream().eventsource();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .unwrap();
    assert!(first.unwrap().is_ok());
    let stopping = tokio::spawn(d.stop());
    let ended = tokio::time::timeout(Duration::from_secs(8), async {
        while let Some(Ok(_)) = stream.next().await {}
    })
    .await;
    assert!(ended.is_ok(), "the SSE stream stayed open during shutdown");
    stopping.await.unwrap();
}
