//! The store contract: every check is written once against `&dyn Store` and run for the memory,
//! file (redb in a temp dir), Redis and Redis Cluster (three local masters) stores; then Redis-only fault, concurrency and
//! throughput tests, and file-store restart tests.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentd::ids::{CallId, RunId};
use agentd::store::{
    Checkpoint, CheckpointStore, Control, CreateOutcome, Error, EventLog, Lease, RunFilter,
    SharedStore, Store,
};

use crate::redis_support::{ckpt, ev, eventually};

const TTL: Duration = Duration::from_secs(30);

/// Fresh run ids in creation (= lexical) order.
fn ids(n: usize) -> Vec<RunId> {
    let mut v: Vec<RunId> = (0..n).map(|_| RunId::generate()).collect();
    v.sort();
    v
}

async fn created(s: &dyn Store, tenant: &str) -> RunId {
    let run = RunId::generate();
    let out = s
        .create(&ckpt(&run, tenant, 1), &[ev(1)], None)
        .await
        .unwrap();
    assert_eq!(out, CreateOutcome::Created);
    run
}

/// Commits `version → version + 1` with one event.
async fn step(s: &dyn Store, lease: &Lease, c: &Checkpoint) -> Checkpoint {
    let mut next = c.clone();
    next.version += 1;
    next.body = format!("{{\"v\":{}}}", next.version);
    s.commit(lease, &next, c.version, &[ev(next.version)])
        .await
        .unwrap();
    next
}

async fn create_and_idempotent_create(s: &dyn Store) {
    let [a, b, c] = <[RunId; 3]>::try_from(ids(3)).unwrap();
    let first = ckpt(&a, "t1", 1);
    assert_eq!(
        s.create(&first, &[ev(1)], Some("key-1")).await.unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(s.load(&a).await.unwrap(), Some(first.clone()));
    assert_eq!(s.read(&a, 0, 10).await.unwrap(), vec![ev(1)]);

    // Same tenant, same key: the first run, nothing written for the second.
    assert_eq!(
        s.create(&ckpt(&b, "t1", 1), &[ev(1)], Some("key-1"))
            .await
            .unwrap(),
        CreateOutcome::Existing(a.clone())
    );
    assert_eq!(s.load(&b).await.unwrap(), None);
    assert!(s.read(&b, 0, 10).await.unwrap().is_empty());

    // Another tenant may use the same key.
    assert_eq!(
        s.create(&ckpt(&b, "t2", 1), &[ev(1)], Some("key-1"))
            .await
            .unwrap(),
        CreateOutcome::Created
    );

    // Retrying an applied create (reply lost) succeeds and writes nothing new.
    assert_eq!(
        s.create(&first, &[ev(1)], None).await.unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(s.read(&a, 0, 10).await.unwrap(), vec![ev(1)]);

    // Creating an existing run with other content is a conflict and changes nothing.
    let mut other = first.clone();
    other.body = "{}".into();
    let err = s.create(&other, &[ev(1)], None).await.unwrap_err();
    assert!(matches!(err, Error::VersionConflict { .. }), "{err:?}");
    assert_eq!(s.load(&a).await.unwrap(), Some(first));

    // A create whose events do not start at 1 writes nothing and does not use up its key.
    let err = s
        .create(&ckpt(&c, "t1", 1), &[ev(2)], Some("key-2"))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        Error::SequenceGap {
            run: c.clone(),
            seq: 2
        }
    );
    assert_eq!(s.load(&c).await.unwrap(), None);
    assert_eq!(
        s.create(&ckpt(&c, "t1", 1), &[ev(1)], Some("key-2"))
            .await
            .unwrap(),
        CreateOutcome::Created
    );
}

async fn commit_is_compare_and_set(s: &dyn Store) {
    let run = created(s, "t1").await;
    let lease = s.claim(&run, "node-a", TTL).await.unwrap();
    let v1 = s.load(&run).await.unwrap().unwrap();
    let v2 = step(s, &lease, &v1).await;
    assert_eq!(s.load(&run).await.unwrap(), Some(v2.clone()));

    // A stale writer (expects 1) is rejected and nothing is written.
    let mut stale = v1.clone();
    stale.version = 2;
    stale.body = "{\"stale\":true}".into();
    let err = s.commit(&lease, &stale, 1, &[ev(2)]).await.unwrap_err();
    assert_eq!(
        err,
        Error::VersionConflict {
            run: run.clone(),
            expected: 1,
            found: 2
        }
    );
    assert_eq!(s.load(&run).await.unwrap(), Some(v2.clone()));
    assert_eq!(s.read(&run, 0, 10).await.unwrap(), vec![ev(1), ev(2)]);

    // Retrying the applied commit (its reply was lost) is recognised, not a conflict.
    s.commit(&lease, &v2, 1, &[ev(2)]).await.unwrap();
    assert_eq!(s.read(&run, 0, 10).await.unwrap().len(), 2);

    // Unknown run.
    let ghost = RunId::generate();
    let err = s
        .commit(&lease, &ckpt(&ghost, "t1", 2), 1, &[ev(2)])
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NotFound(_) | Error::Fenced { .. }),
        "{err:?}"
    );
}

async fn fencing(s: &dyn Store) {
    let run = created(s, "t1").await;
    let v1 = s.load(&run).await.unwrap().unwrap();

    // No lease, no commit.
    let fake = Lease {
        run_id: run.clone(),
        owner: "nobody".into(),
        token: 1,
    };
    let err = s.commit(&fake, &ckpt(&run, "t1", 2), 1, &[ev(2)]).await;
    assert!(matches!(err, Err(Error::Fenced { .. })), "{err:?}");

    let first = s
        .claim(&run, "node-a", Duration::from_millis(150))
        .await
        .unwrap();
    // The same owner claiming again is a new incarnation (a restarted process or actor): it
    // gets a larger token, which fences out the older one.
    let a = s
        .claim(&run, "node-a", Duration::from_millis(150))
        .await
        .unwrap();
    assert!(a.token > first.token, "{} > {}", a.token, first.token);
    let err = s.commit(&first, &ckpt(&run, "t1", 2), 1, &[ev(2)]).await;
    assert!(matches!(err, Err(Error::Fenced { .. })), "{err:?}");
    let err = s.claim(&run, "node-b", TTL).await.unwrap_err();
    assert_eq!(
        err,
        Error::LeaseHeld {
            run: run.clone(),
            owner: "node-a".into()
        }
    );

    // A's lease expires; B takes over with a larger token.
    let b = eventually(
        "node-a's lease to expire",
        Duration::from_secs(5),
        || async { s.claim(&run, "node-b", TTL).await.ok() },
    )
    .await;
    assert!(b.token > a.token, "{} > {}", b.token, a.token);

    // A is fenced and writes nothing; A cannot take the lease back while B holds it.
    let err = s.commit(&a, &ckpt(&run, "t1", 2), 1, &[ev(2)]).await;
    assert_eq!(
        err,
        Err(Error::Fenced {
            run: run.clone(),
            token: a.token
        })
    );
    assert_eq!(s.load(&run).await.unwrap(), Some(v1.clone()));
    assert_eq!(s.read(&run, 0, 10).await.unwrap().len(), 1);
    let err = s.claim(&run, "node-a", TTL).await.unwrap_err();
    assert!(matches!(err, Error::LeaseHeld { ref owner, .. } if owner == "node-b"));

    // B writes; after B releases, B's token is dead too and the next owner's token is larger.
    let v2 = step(s, &b, &v1).await;
    s.release(&a).await.unwrap(); // a stale release is a no-op
    step(s, &b, &v2).await;
    s.release(&b).await.unwrap();
    let err = s.commit(&b, &ckpt(&run, "t1", 4), 3, &[ev(4)]).await;
    assert!(matches!(err, Err(Error::Fenced { .. })), "{err:?}");
    let c = s.claim(&run, "node-c", TTL).await.unwrap();
    assert!(c.token > b.token);

    let ghost = RunId::generate();
    assert_eq!(
        s.claim(&ghost, "node-a", TTL).await.unwrap_err(),
        Error::NotFound(ghost)
    );
}

async fn event_seq_is_gap_free(s: &dyn Store) {
    let run = created(s, "t1").await;
    let lease = s.claim(&run, "node-a", TTL).await.unwrap();
    let v1 = s.load(&run).await.unwrap().unwrap();
    let mut next = v1.clone();
    next.version = 3;

    let err = s.commit(&lease, &next, 1, &[ev(3)]).await.unwrap_err();
    assert_eq!(
        err,
        Error::SequenceGap {
            run: run.clone(),
            seq: 3
        }
    );
    let err = s
        .commit(&lease, &next, 1, &[ev(2), ev(4)])
        .await
        .unwrap_err();
    assert_eq!(
        err,
        Error::SequenceGap {
            run: run.clone(),
            seq: 4
        }
    );
    let err = s.commit(&lease, &next, 1, &[ev(1)]).await.unwrap_err();
    assert_eq!(
        err,
        Error::SequenceGap {
            run: run.clone(),
            seq: 1
        }
    );
    // Nothing of the rejected commits was written.
    assert_eq!(s.load(&run).await.unwrap(), Some(v1));
    assert_eq!(s.read(&run, 0, 10).await.unwrap(), vec![ev(1)]);

    s.commit(&lease, &next, 1, &[ev(2), ev(3)]).await.unwrap();
    assert_eq!(
        s.read(&run, 0, 10).await.unwrap(),
        vec![ev(1), ev(2), ev(3)]
    );
    // A commit without events keeps the log as it is.
    let mut v4 = next.clone();
    v4.version = 4;
    s.commit(&lease, &v4, 3, &[]).await.unwrap();
    assert_eq!(s.read(&run, 0, 10).await.unwrap().len(), 3);
}

async fn read_after_and_limit(s: &dyn Store) {
    let run = created(s, "t1").await;
    let lease = s.claim(&run, "node-a", TTL).await.unwrap();
    let mut c = s.load(&run).await.unwrap().unwrap();
    for _ in 0..9 {
        c = step(s, &lease, &c).await;
    }
    let seqs = |v: Vec<agentd::store::EventRecord>| v.iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(
        seqs(s.read(&run, 0, 100).await.unwrap()),
        (1..=10).collect::<Vec<_>>()
    );
    assert_eq!(seqs(s.read(&run, 3, 4).await.unwrap()), vec![4, 5, 6, 7]);
    assert_eq!(seqs(s.read(&run, 9, 4).await.unwrap()), vec![10]);
    assert!(s.read(&run, 10, 5).await.unwrap().is_empty());
    assert!(s.read(&run, 0, 0).await.unwrap().is_empty());
    assert!(s.read(&RunId::generate(), 0, 5).await.unwrap().is_empty());
    assert_eq!(s.read(&run, 1, 1).await.unwrap(), vec![ev(2)]);
}

/// Commits carrying several events (a commit window's transitions, a create with two) read
/// back event by event: a cursor inside one commit's events, and a limit that cuts one, give
/// exactly the events after the cursor, in order.
async fn reads_split_commits_of_several_events(s: &dyn Store) {
    let run = RunId::generate();
    s.create(&ckpt(&run, "t1", 2), &[ev(1), ev(2)], None)
        .await
        .unwrap();
    let lease = s.claim(&run, "node-a", TTL).await.unwrap();
    let mut c = s.load(&run).await.unwrap().unwrap();
    for n in [3u64, 1, 4] {
        let mut next = c.clone();
        next.version += n;
        let events: Vec<_> = (c.version + 1..=next.version).map(ev).collect();
        s.commit(&lease, &next, c.version, &events).await.unwrap();
        c = next;
    }
    let seqs = |v: Vec<agentd::store::EventRecord>| v.iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(
        seqs(s.read(&run, 0, 100).await.unwrap()),
        (1..=10).collect::<Vec<_>>()
    );
    for after in 0..=10u64 {
        for limit in 1..=4usize {
            let want: Vec<u64> = (after + 1..=10).take(limit).collect();
            assert_eq!(
                seqs(s.read(&run, after, limit).await.unwrap()),
                want,
                "after {after}, limit {limit}"
            );
        }
    }
    assert_eq!(s.read(&run, 3, 1).await.unwrap(), vec![ev(4)]);
}

async fn active_index_follows_terminal(s: &dyn Store) {
    let [a, b, done] = <[RunId; 3]>::try_from(ids(3)).unwrap();
    for r in [&a, &b] {
        s.create(&ckpt(r, "t1", 1), &[ev(1)], None).await.unwrap();
    }
    let mut finished = ckpt(&done, "t1", 1);
    finished.terminal = true;
    finished.status = "succeeded".into();
    s.create(&finished, &[ev(1)], None).await.unwrap();
    let active = |v: Vec<RunId>| v.into_iter().collect::<HashSet<_>>();
    let mine: HashSet<RunId> = [a.clone(), b.clone()].into();
    assert!(active(s.active_runs().await.unwrap()).is_superset(&mine));
    assert!(!s.active_runs().await.unwrap().contains(&done));

    let lease = s.claim(&a, "node-a", TTL).await.unwrap();
    let mut end = ckpt(&a, "t1", 2);
    end.terminal = true;
    end.status = "failed".into();
    s.commit(&lease, &end, 1, &[ev(2)]).await.unwrap();
    let now = s.active_runs().await.unwrap();
    assert!(!now.contains(&a));
    assert!(now.contains(&b));
    let mut sorted = now.clone();
    sorted.sort();
    assert_eq!(now, sorted, "active_runs is sorted");
}

async fn list_runs_isolation_filters_and_cursor(s: &dyn Store) {
    let tenant = format!("acme:{{x}}*{}", uuid::Uuid::new_v4().simple());
    let other = format!("other-{}", uuid::Uuid::new_v4().simple());
    let runs = ids(7);
    for (i, r) in runs.iter().enumerate() {
        let mut c = ckpt(r, &tenant, 1);
        c.agent = if i % 2 == 0 { "even" } else { "odd" }.into();
        if i == 3 {
            c.status = "waiting_input".into();
        }
        s.create(&c, &[ev(1)], None).await.unwrap();
    }
    let theirs = ids(2);
    for r in &theirs {
        s.create(&ckpt(r, &other, 1), &[ev(1)], None).await.unwrap();
    }

    // Newest first, paged with the cursor, no duplicates, no gaps.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = s
            .list_runs(&tenant, &RunFilter::default(), cursor.as_deref(), 3)
            .await
            .unwrap();
        pages += 1;
        assert!(page.items.len() <= 3);
        seen.extend(page.items.iter().map(|c| c.run_id.clone()));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
        assert!(pages < 10, "pagination does not end");
    }
    let mut expected = runs.clone();
    expected.reverse();
    assert_eq!(seen, expected);
    assert_eq!(pages, 3);

    // Filters.
    let odd = s
        .list_runs(
            &tenant,
            &RunFilter {
                agent: Some("odd".into()),
                status: None,
            },
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(
        odd.items
            .iter()
            .map(|c| c.run_id.clone())
            .collect::<Vec<_>>(),
        vec![runs[5].clone(), runs[3].clone(), runs[1].clone()]
    );
    assert!(odd.next_cursor.is_none());
    let waiting = s
        .list_runs(
            &tenant,
            &RunFilter {
                status: Some("waiting_input".into()),
                agent: Some("odd".into()),
            },
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(waiting.items.len(), 1);
    assert_eq!(waiting.items[0].run_id, runs[3]);
    let filtered_page = s
        .list_runs(
            &tenant,
            &RunFilter {
                agent: Some("even".into()),
                status: None,
            },
            None,
            2,
        )
        .await
        .unwrap();
    assert_eq!(filtered_page.items.len(), 2);
    let rest = s
        .list_runs(
            &tenant,
            &RunFilter {
                agent: Some("even".into()),
                status: None,
            },
            filtered_page.next_cursor.as_deref(),
            2,
        )
        .await
        .unwrap();
    assert_eq!(
        rest.items
            .iter()
            .map(|c| c.run_id.clone())
            .collect::<Vec<_>>(),
        vec![runs[2].clone(), runs[0].clone()]
    );
    assert!(rest.next_cursor.is_none());

    // Isolation.
    let page = s
        .list_runs(&other, &RunFilter::default(), None, 10)
        .await
        .unwrap();
    let mut theirs_desc = theirs.clone();
    theirs_desc.reverse();
    assert_eq!(
        page.items
            .iter()
            .map(|c| c.run_id.clone())
            .collect::<Vec<_>>(),
        theirs_desc
    );
    let none = s
        .list_runs("nobody-here", &RunFilter::default(), None, 10)
        .await
        .unwrap();
    assert!(none.items.is_empty() && none.next_cursor.is_none());
}

async fn controls_inbox_keeps_order(s: &dyn Store) {
    let run = created(s, "t1").await;
    let msgs = vec![
        Control::Input { text: "hi".into() },
        Control::Approve {
            call_id: CallId::new(1, 0),
            arguments: None,
            by: None,
        },
        Control::Cancel {
            reason: Some("done".into()),
        },
    ];
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(s.push_control(&run, m).await.unwrap(), i as u64 + 1);
    }
    let all = s.controls(&run, 0).await.unwrap();
    assert_eq!(all.iter().map(|c| c.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(
        all.iter().map(|c| c.control.clone()).collect::<Vec<_>>(),
        msgs
    );
    assert!(all.iter().all(|c| c.at_ms > 0));
    let tail = s.controls(&run, 2).await.unwrap();
    assert_eq!(tail.len(), 1);
    assert_eq!(tail[0].seq, 3);
    assert!(s.controls(&run, 3).await.unwrap().is_empty());
    let ghost = RunId::generate();
    assert_eq!(
        s.push_control(&ghost, &msgs[0]).await.unwrap_err(),
        Error::NotFound(ghost.clone())
    );
    assert!(s.controls(&ghost, 0).await.unwrap().is_empty());
}

async fn epoch_marker_is_stable(s: &dyn Store) {
    let e1 = s.epoch().await.unwrap();
    assert!(!e1.is_empty());
    s.ping().await.unwrap();
    assert_eq!(s.epoch().await.unwrap(), e1);
}

/// Two writers holding the same lease race on every version: exactly one wins each.
async fn racing_writers_one_wins_each_version(s: &dyn Store) {
    let run = created(s, "t1").await;
    let lease = s.claim(&run, "node-a", TTL).await.unwrap();
    for v in 1..=20u64 {
        let attempt = |who: &str| {
            let mut c = ckpt(&run, "t1", v + 1);
            c.body = format!("{{\"writer\":\"{who}\"}}");
            c
        };
        let (x, y) = (attempt("x"), attempt("y"));
        let events = [ev(v + 1)];
        let (rx, ry) = tokio::join!(
            s.commit(&lease, &x, v, &events),
            s.commit(&lease, &y, v, &events)
        );
        let wins = [&rx, &ry].iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "version {v}: {rx:?} / {ry:?}");
        for r in [rx, ry] {
            if let Err(e) = r {
                assert!(matches!(e, Error::VersionConflict { found, .. } if found == v + 1));
            }
        }
    }
    assert_eq!(s.read(&run, 0, 100).await.unwrap().len(), 21);
}

/// A run id whose UUIDv7 says it was made at the Unix epoch: an index entry for it with no
/// checkpoint is long dangling.
fn ancient_id() -> RunId {
    "run_000000000000700080000000000000aa".parse().unwrap()
}

fn now() -> u64 {
    agentd::clock::now_ms()
}

async fn renew_returns_lost_leases(s: &dyn Store) {
    let [kept, released, taken, lapsed] = <[RunId; 4]>::try_from(ids(4)).unwrap();
    for r in [&kept, &released, &taken, &lapsed] {
        s.create(&ckpt(r, "t1", 1), &[ev(1)], None).await.unwrap();
    }
    let short = Duration::from_millis(150);
    let l_kept = s.claim(&kept, "node-a", TTL).await.unwrap();
    let l_released = s.claim(&released, "node-a", TTL).await.unwrap();
    // `lapsed` first: it must have lapsed by the time `taken` has.
    let l_lapsed = s.claim(&lapsed, "node-a", short).await.unwrap();
    let l_taken = s.claim(&taken, "node-a", short).await.unwrap();
    assert_eq!(s.renew_leases("node-a", &[], TTL).await.unwrap(), vec![]);
    s.release(&l_released).await.unwrap();
    let l_b = eventually(
        "node-a's short lease to lapse",
        Duration::from_secs(5),
        || async { s.claim(&taken, "node-b", TTL).await.ok() },
    )
    .await;
    assert!(l_b.token > l_taken.token);
    assert_eq!(s.lease_holder(&lapsed).await.unwrap(), None, "expired");
    let ghost = Lease {
        run_id: RunId::generate(),
        owner: "node-a".into(),
        token: 1,
    };
    let all = [
        l_kept.clone(),
        l_released,
        l_taken,
        l_lapsed.clone(),
        ghost.clone(),
    ];
    let lost: HashSet<RunId> = s
        .renew_leases("node-a", &all, TTL)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let expected: HashSet<RunId> = [released.clone(), taken.clone(), ghost.run_id].into();
    assert_eq!(lost, expected);
    // Renewed: the expired lease nobody took is ours again, live, and commits still work.
    assert_eq!(
        s.lease_holder(&kept).await.unwrap().as_deref(),
        Some("node-a")
    );
    assert_eq!(
        s.lease_holder(&lapsed).await.unwrap().as_deref(),
        Some("node-a")
    );
    assert_eq!(
        s.lease_holder(&taken).await.unwrap().as_deref(),
        Some("node-b")
    );
    assert_eq!(s.lease_holder(&released).await.unwrap(), None);
    let err = s.claim(&lapsed, "node-b", TTL).await.unwrap_err();
    assert!(matches!(err, Error::LeaseHeld { .. }), "{err:?}");
    let c = s.load(&lapsed).await.unwrap().unwrap();
    step(s, &l_lapsed, &c).await;
    // Another owner cannot renew a lease by its token.
    assert_eq!(
        s.renew_leases("node-b", std::slice::from_ref(&l_kept), TTL)
            .await
            .unwrap(),
        vec![kept.clone()]
    );
    // Renewed leases are not due before their new expiry.
    let due = s.due_runs(now(), 100).await.unwrap();
    assert!(!due.contains(&kept) && !due.contains(&lapsed), "{due:?}");
}

/// Waits for `run`, whose owner `a` renews nothing, to fall due when its lease lapses, then
/// for node-b to claim it; the new lease's token is larger.
async fn taken_over_after_lapse(s: &dyn Store, run: &RunId, a: &Lease) -> Lease {
    eventually("the run to fall due", Duration::from_secs(5), || async {
        s.due_runs(now(), 100)
            .await
            .unwrap()
            .contains(run)
            .then_some(())
    })
    .await;
    let b = eventually("node-b to claim it", Duration::from_secs(5), || async {
        s.claim(run, "node-b", TTL).await.ok()
    })
    .await;
    assert!(b.token > a.token, "{} > {}", b.token, a.token);
    b
}

async fn dead_owner_runs_fall_due_and_move_on(s: &dyn Store) {
    let run = created(s, "t1").await;
    let a = s
        .claim(&run, "node-a", Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(
        s.lease_holder(&run).await.unwrap().as_deref(),
        Some("node-a")
    );
    // node-a dies: it renews nothing; the run falls due when its lease lapses.
    taken_over_after_lapse(s, &run, &a).await;
    assert!(!s.due_runs(now(), 100).await.unwrap().contains(&run));
    assert!(
        s.due_runs(now() + 2 * TTL.as_millis() as u64, 100)
            .await
            .unwrap()
            .contains(&run)
    );
    let err = s.commit(&a, &ckpt(&run, "t1", 2), 1, &[ev(2)]).await;
    assert!(matches!(err, Err(Error::Fenced { .. })), "{err:?}");
}

async fn due_index_follows_release_and_set_due(s: &dyn Store) {
    let runs = ids(6);
    let [now_run, later, idle, stale, done, fresh] = <[RunId; 6]>::try_from(runs.clone()).unwrap();
    let mut leases = Vec::new();
    for r in &runs {
        s.create(&ckpt(r, "t1", 1), &[ev(1)], None).await.unwrap();
        leases.push(s.claim(r, "node-a", TTL).await.unwrap());
    }
    let t0 = now();
    let hour = 3_600_000;
    s.release_many(&leases[0..1], Some(t0)).await.unwrap();
    s.release_many(&leases[1..2], Some(t0 + hour))
        .await
        .unwrap();
    s.release_many(&leases[2..3], None).await.unwrap();
    for r in [&now_run, &later, &idle] {
        assert_eq!(s.lease_holder(r).await.unwrap(), None, "released");
    }
    // A release of a lease no longer held changes nothing, due time included.
    let newer = s.claim(&stale, "node-a", TTL).await.unwrap();
    s.release_many(&leases[3..4], Some(t0)).await.unwrap();
    assert_eq!(
        s.lease_holder(&stale).await.unwrap().as_deref(),
        Some("node-a")
    );
    let c = s.load(&stale).await.unwrap().unwrap();
    step(s, &newer, &c).await;

    let due_now = s.due_runs(now(), 100).await.unwrap();
    assert!(due_now.contains(&now_run), "{due_now:?}");
    for r in [&later, &idle, &stale] {
        assert!(!due_now.contains(r), "{r} is not due now: {due_now:?}");
    }
    let all_due = s.due_runs(u64::MAX, 100).await.unwrap();
    let pos = |r: &RunId| all_due.iter().position(|x| x == r);
    assert!(pos(&now_run) < pos(&later), "earliest first: {all_due:?}");
    assert!(pos(&later).is_some() && pos(&stale).is_some());
    assert_eq!(pos(&idle), None, "released with no due time");

    // set_due puts a run in and takes it out; limit holds.
    s.set_due(&fresh, Some(t0 - 1)).await.unwrap();
    assert!(s.due_runs(now(), 100).await.unwrap().contains(&fresh));
    assert_eq!(s.due_runs(u64::MAX, 1).await.unwrap().len(), 1);
    s.set_due(&fresh, None).await.unwrap();
    assert!(!s.due_runs(u64::MAX, 100).await.unwrap().contains(&fresh));

    // A terminal commit leaves the index.
    s.set_due(&done, Some(t0)).await.unwrap();
    let mut end = ckpt(&done, "t1", 2);
    end.terminal = true;
    end.status = "succeeded".into();
    s.commit(&leases[4], &end, 1, &[ev(2)]).await.unwrap();
    assert!(!s.due_runs(u64::MAX, 100).await.unwrap().contains(&done));
    // And a due time set for a terminal run later (a stale writer) is never returned.
    s.set_due(&done, Some(t0)).await.unwrap();
    assert!(!s.due_runs(u64::MAX, 100).await.unwrap().contains(&done));
}

async fn dangling_due_entries_are_skipped(s: &dyn Store) {
    let live = created(s, "t1").await;
    let young_ghost = RunId::generate();
    let old_ghost = ancient_id();
    for r in [&old_ghost, &young_ghost, &live] {
        s.set_due(r, Some(1)).await.unwrap();
    }
    for _ in 0..2 {
        assert_eq!(s.due_runs(now(), 100).await.unwrap(), vec![live.clone()]);
    }
    assert_eq!(s.due_runs(now(), 1).await.unwrap(), vec![live.clone()]);
}

async fn node_ids_are_held_by_one_instance(s: &dyn Store) {
    let node = format!("node-{}", uuid::Uuid::new_v4().simple());
    s.register_node(&node, "inst-1", TTL).await.unwrap();
    s.register_node(&node, "inst-1", TTL).await.unwrap();
    let err = s.register_node(&node, "inst-2", TTL).await.unwrap_err();
    assert_eq!(
        err,
        Error::NodeIdInUse {
            node: node.clone(),
            holder: "inst-1".into()
        }
    );
    assert!(!err.is_retryable());
    assert_eq!(
        err.to_string(),
        format!("node id {node} is held by another live process")
    );
    assert_eq!(
        s.heartbeat_node(&node, "inst-2", TTL).await.unwrap_err(),
        Error::NodeIdInUse {
            node: node.clone(),
            holder: "inst-1".into()
        }
    );
    s.heartbeat_node(&node, "inst-1", TTL).await.unwrap();
    // Only the holder can give it up.
    s.unregister_node(&node, "inst-2").await.unwrap();
    assert!(s.register_node(&node, "inst-2", TTL).await.is_err());
    s.unregister_node(&node, "inst-1").await.unwrap();
    s.register_node(&node, "inst-2", TTL).await.unwrap();

    // A hold that lapses (its process died) is free for the next process.
    let other = format!("node-{}", uuid::Uuid::new_v4().simple());
    s.register_node(&other, "inst-1", Duration::from_millis(150))
        .await
        .unwrap();
    assert!(s.register_node(&other, "inst-2", TTL).await.is_err());
    eventually(
        "the lapsed node id to be free",
        Duration::from_secs(5),
        || async { s.register_node(&other, "inst-2", TTL).await.ok() },
    )
    .await;
    assert!(s.heartbeat_node(&other, "inst-1", TTL).await.is_err());
}

async fn wakeups_block_time_out_and_deliver(s: &dyn Store) {
    let node = format!("node-{}", uuid::Uuid::new_v4().simple());
    let [r1, r2, r3] = <[RunId; 3]>::try_from(ids(3)).unwrap();
    // Sent before the reader's first look: "" means only wake-ups from now on.
    s.notify_node(&node, &r1).await.unwrap();
    let start = Instant::now();
    let (none, cursor) = s
        .wakeups(&node, "", Duration::from_millis(300))
        .await
        .unwrap();
    let took = start.elapsed();
    assert!(none.is_empty(), "{none:?}");
    assert!(
        took >= Duration::from_millis(250),
        "returned early: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "no timeout: {took:?}");

    // Wake-ups after the cursor arrive in order, for this node only.
    s.notify_node("someone-else", &r3).await.unwrap();
    s.notify_node(&node, &r1).await.unwrap();
    s.notify_node(&node, &r2).await.unwrap();
    let (got, cursor) = s
        .wakeups(&node, &cursor, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(got, vec![r1.clone(), r2.clone()]);
    let (none, cursor) = s.wakeups(&node, &cursor, Duration::ZERO).await.unwrap();
    assert!(none.is_empty(), "{none:?}");

    // A blocked reader is woken, and other store traffic is not held up meanwhile.
    let run = created(s, "t1").await;
    let reader = async {
        let start = Instant::now();
        let r = s.wakeups(&node, &cursor, Duration::from_secs(30)).await;
        (r, start.elapsed())
    };
    let others = async {
        let start = Instant::now();
        for _ in 0..20 {
            s.load(&run).await.unwrap().unwrap();
        }
        s.ping().await.unwrap();
        let took = start.elapsed();
        s.notify_node(&node, &r3).await.unwrap();
        took
    };
    let ((woken, waited), others_took) = tokio::join!(reader, others);
    let (woken, _) = woken.unwrap();
    assert_eq!(woken, vec![r3]);
    // Generous bounds for a loaded machine, far below the 30 s block: a stall would show.
    assert!(waited < Duration::from_secs(15), "not woken: {waited:?}");
    assert!(
        others_took < Duration::from_secs(10),
        "store traffic waited for the blocked read: {others_took:?}"
    );
}

async fn client_key_retry_creates_the_missing_checkpoint(s: &dyn Store) {
    let run = RunId::generate();
    let first = ckpt(&run, "t1", 1);
    assert_eq!(
        s.create(&first, &[ev(1)], Some("k-retry")).await.unwrap(),
        CreateOutcome::Created
    );
    // The same run with the same key is a retry, not `Existing(itself)`.
    assert_eq!(
        s.create(&first, &[ev(1)], Some("k-retry")).await.unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(s.read(&run, 0, 10).await.unwrap(), vec![ev(1)]);
}

/// The status and agent filters read indexes that follow every commit: after a seeded random
/// walk of status changes over a dozen runs (two agents, finished runs never change again),
/// every filtered listing, paged one at a time too, is exactly what the runs now are.
async fn filtered_listings_follow_status_changes(s: &dyn Store) {
    let tenant = format!("walk-{}", uuid::Uuid::new_v4().simple());
    let runs = ids(12);
    let mut current = Vec::new();
    let mut leases = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let mut c = ckpt(r, &tenant, 1);
        c.status = "created".into();
        c.agent = if i % 3 == 0 { "triage" } else { "demo" }.into();
        s.create(&c, &[ev(1)], None).await.unwrap();
        leases.push(s.claim(r, "node-a", TTL).await.unwrap());
        current.push(c);
    }
    check_filtered_listings(s, &tenant, &current).await;
    // A small linear congruential generator: the same walk every time.
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |n: usize| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) as usize) % n
    };
    for round in 0..48 {
        let i = next(runs.len());
        let c = &current[i];
        // A finished run only gets late results: commits in the same status.
        let status = if c.terminal {
            c.status.clone()
        } else {
            STATUSES[next(STATUSES.len())].to_owned()
        };
        let mut n = c.clone();
        n.version += 1;
        n.terminal = matches!(status.as_str(), "succeeded" | "failed" | "cancelled");
        n.status = status;
        s.commit(&leases[i], &n, c.version, &[ev(n.version)])
            .await
            .unwrap();
        current[i] = n;
        if round % 12 == 11 {
            check_filtered_listings(s, &tenant, &current).await;
        }
    }
}

const STATUSES: [&str; 7] = [
    "created",
    "running",
    "waiting_approval",
    "waiting_input",
    "succeeded",
    "failed",
    "cancelled",
];

/// Every status (and status + agent, and agent) listing of `tenant` is exactly `current`'s.
async fn check_filtered_listings(s: &dyn Store, tenant: &str, current: &[Checkpoint]) {
    for status in STATUSES {
        for agent in [None, Some("triage")] {
            let expected: Vec<RunId> = current
                .iter()
                .rev()
                .filter(|c| c.status == status && agent.is_none_or(|a| c.agent == a))
                .map(|c| c.run_id.clone())
                .collect();
            let filter = RunFilter {
                status: Some(status.into()),
                agent: agent.map(str::to_owned),
            };
            let page = s.list_runs(tenant, &filter, None, 100).await.unwrap();
            let got: Vec<RunId> = page.items.iter().map(|c| c.run_id.clone()).collect();
            assert_eq!(got, expected, "status {status}, agent {agent:?}");
            assert!(page.items.iter().all(|c| c.status == status));
            // One at a time, through the cursor.
            let mut paged = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                let page = s
                    .list_runs(tenant, &filter, cursor.as_deref(), 1)
                    .await
                    .unwrap();
                paged.extend(page.items.iter().map(|c| c.run_id.clone()));
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
                assert!(paged.len() <= current.len(), "pagination does not end");
            }
            assert_eq!(paged, expected, "paged: status {status}, agent {agent:?}");
        }
    }
    let triage = s
        .list_runs(
            tenant,
            &RunFilter {
                status: None,
                agent: Some("triage".into()),
            },
            None,
            100,
        )
        .await
        .unwrap();
    let expected: Vec<RunId> = current
        .iter()
        .rev()
        .filter(|c| c.agent == "triage")
        .map(|c| c.run_id.clone())
        .collect();
    let got: Vec<RunId> = triage.items.iter().map(|c| c.run_id.clone()).collect();
    assert_eq!(got, expected);
}

/// The transcript is stored apart, append-only: a create stores its entries, a commit appends
/// only the new ones where the transcript ends, a load returns the whole of it; a write that
/// does not continue it is refused and writes nothing; a replayed commit appends nothing.
async fn transcript_is_append_only(s: &dyn Store) {
    let run = RunId::generate();
    let mut c = ckpt(&run, "t", 1);
    c.transcript = vec![r#"{"m":1}"#.into(), r#"{"m":2}"#.into()];
    s.create(&c, &[ev(1)], None).await.unwrap();
    let loaded = s.load(&run).await.unwrap().unwrap();
    assert_eq!(loaded.transcript, c.transcript);
    assert_eq!(loaded.body, c.body);
    let lease = s.claim(&run, "node-a", TTL).await.unwrap();

    let mut next = ckpt(&run, "t", 2);
    next.transcript_from = 2;
    next.transcript = vec![r#"{"m":3}"#.into()];
    s.commit(&lease, &next, 1, &[ev(2)]).await.unwrap();
    // The reply was lost; the same commit again is a replay, not a second append.
    s.commit(&lease, &next, 1, &[ev(2)]).await.unwrap();
    let loaded = s.load(&run).await.unwrap().unwrap();
    assert_eq!(loaded.version, 2);
    assert_eq!(
        loaded.transcript,
        vec![r#"{"m":1}"#, r#"{"m":2}"#, r#"{"m":3}"#]
    );
    // Each entry is read by reference, alone; past the end, or of a run never stored: none.
    for (i, entry) in loaded.transcript.iter().enumerate() {
        assert_eq!(
            s.transcript_entry(&run, i as u64).await.unwrap().as_ref(),
            Some(entry)
        );
    }
    assert_eq!(s.transcript_entry(&run, 3).await.unwrap(), None);
    assert_eq!(s.transcript_entry(&run, u64::MAX).await.unwrap(), None);
    assert_eq!(
        s.transcript_entry(&RunId::generate(), 0).await.unwrap(),
        None
    );

    // Continuing from the wrong place is a torn write: refused, nothing stored.
    let mut torn = ckpt(&run, "t", 3);
    torn.transcript_from = 1;
    torn.transcript = vec![r#"{"m":"x"}"#.into()];
    let err = s.commit(&lease, &torn, 2, &[ev(3)]).await.unwrap_err();
    assert!(matches!(err, Error::Corrupt(_)), "{err:?}");
    let loaded = s.load(&run).await.unwrap().unwrap();
    assert_eq!(loaded.version, 2);
    assert_eq!(loaded.transcript.len(), 3);
    assert_eq!(
        s.read(&run, 0, 10).await.unwrap().len(),
        2,
        "no event either"
    );

    // A commit that adds no message sends no entry.
    let mut quiet = ckpt(&run, "t", 3);
    quiet.transcript_from = 3;
    s.commit(&lease, &quiet, 2, &[ev(3)]).await.unwrap();
    assert_eq!(s.load(&run).await.unwrap().unwrap().transcript.len(), 3);
    // A long transcript (a migrated run's first rewrite stores all of it) in one write.
    let long = RunId::generate();
    let mut c = ckpt(&long, "t", 1);
    c.transcript = (0..1234).map(|i| format!(r#"{{"m":{i}}}"#)).collect();
    s.create(&c, &[ev(1)], None).await.unwrap();
    let loaded = s.load(&long).await.unwrap().unwrap();
    assert_eq!(loaded.transcript, c.transcript);
    // A listing carries no transcript.
    let page = s
        .list_runs("t", &RunFilter::default(), None, 100)
        .await
        .unwrap();
    let listed = page.items.iter().find(|c| c.run_id == run).unwrap();
    assert!(listed.transcript.is_empty());
}

/// A create that claims: the creating node owns the new run at once (its commits pass, other
/// nodes' claims are refused, the run is due when the lease lapses, and a later claim fences
/// it out); a retry of it claims again as `claim` would; a create with a taken client key
/// claims nothing, nor does a late retry once the run moved on.
async fn create_claimed_owns_the_new_run(s: &dyn Store) {
    let run = RunId::generate();
    let c1 = ckpt(&run, "t1", 1);
    let ttl = Duration::from_millis(300);
    let (out, lease) = s
        .create_claimed(&c1, &[ev(1)], Some("key-c"), "node-a", ttl)
        .await
        .unwrap();
    assert_eq!(out, CreateOutcome::Created);
    let a = lease.expect("the create claimed the run");
    assert_eq!(
        (a.run_id.clone(), a.owner.as_str()),
        (run.clone(), "node-a")
    );
    assert_eq!(
        s.lease_holder(&run).await.unwrap().as_deref(),
        Some("node-a")
    );
    let held = s.claim(&run, "node-b", TTL).await;
    assert!(matches!(held, Err(Error::LeaseHeld { .. })), "{held:?}");
    let c2 = step(s, &a, &c1).await;
    assert_eq!(s.load(&run).await.unwrap().unwrap().version, 2);
    // The same client key again: the existing run, no lease.
    let other = RunId::generate();
    let (out, lease) = s
        .create_claimed(
            &ckpt(&other, "t1", 1),
            &[ev(1)],
            Some("key-c"),
            "node-a",
            TTL,
        )
        .await
        .unwrap();
    assert_eq!((out, lease), (CreateOutcome::Existing(run.clone()), None));
    // node-a dies: it renews nothing; the run falls due when its lease lapses.
    let b = taken_over_after_lapse(s, &run, &a).await;
    let fenced = s.commit(&a, &ckpt(&run, "t1", 3), 2, &[ev(3)]).await;
    assert!(matches!(fenced, Err(Error::Fenced { .. })), "{fenced:?}");
    step(s, &b, &c2).await;
    // The same create once the run has moved on: a conflict, and no lease taken.
    let late = s.create_claimed(&c1, &[ev(1)], None, "node-a", TTL).await;
    assert!(
        matches!(late, Err(Error::VersionConflict { .. })),
        "{late:?}"
    );
    assert_eq!(
        s.lease_holder(&run).await.unwrap().as_deref(),
        Some("node-b")
    );
    // A retry by the owner itself (its reply was lost): claimed again, with a newer token.
    let fresh = RunId::generate();
    let f1 = ckpt(&fresh, "t1", 1);
    let (_, first) = s
        .create_claimed(&f1, &[ev(1)], None, "node-a", TTL)
        .await
        .unwrap();
    let (out, again) = s
        .create_claimed(&f1, &[ev(1)], None, "node-a", TTL)
        .await
        .unwrap();
    assert_eq!(out, CreateOutcome::Created);
    let (first, again) = (first.unwrap(), again.expect("the owner's retry claims"));
    assert!(again.token > first.token);
    let fenced = s.commit(&first, &ckpt(&fresh, "t1", 2), 1, &[ev(2)]).await;
    assert!(matches!(fenced, Err(Error::Fenced { .. })), "{fenced:?}");
    step(s, &again, &f1).await;
}

/// A run's last commit can give its lease up in the same write: the record is terminal, no
/// node holds the run, the old token is fenced out, and the run is in no index of live runs.
async fn commit_final_gives_the_lease_up(s: &dyn Store) {
    let run = created(s, "t1").await;
    let a = s.claim(&run, "node-a", TTL).await.unwrap();
    let c2 = step(s, &a, &ckpt(&run, "t1", 1)).await;
    let mut end = c2.clone();
    end.version = 3;
    end.status = "succeeded".into();
    end.terminal = true;
    s.commit_final(&a, &end, 2, &[ev(3)]).await.unwrap();
    let stored = s.load(&run).await.unwrap().unwrap();
    assert_eq!((stored.version, stored.terminal), (3, true));
    assert_eq!(s.lease_holder(&run).await.unwrap(), None);
    assert!(!s.active_runs().await.unwrap().contains(&run));
    let mut late = end.clone();
    late.version = 4;
    let fenced = s.commit(&a, &late, 3, &[ev(4)]).await;
    assert!(matches!(fenced, Err(Error::Fenced { .. })), "{fenced:?}");
    // Another node may take it at once (its lease was given up, not left to lapse).
    let b = s.claim(&run, "node-b", TTL).await.unwrap();
    assert!(b.token > a.token);
    // A stale writer's final commit gives nothing up.
    let refused = s.commit_final(&a, &late, 3, &[ev(4)]).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    assert_eq!(
        s.lease_holder(&run).await.unwrap().as_deref(),
        Some("node-b")
    );
}

macro_rules! contract {
    ($($check:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $check() {
                    let s = agentd::store::memory::MemoryStore::new();
                    super::$check(&s).await;
                }
            )*
        }
        mod file {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    let dir = tempfile::tempdir().unwrap();
                    let s = agentd::store::file::FileStore::open(dir.path()).await.unwrap();
                    super::$check(&s).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    let Some(s) = crate::redis_support::shared_redis(|c| c).await else { return };
                    super::$check(&s).await;
                    crate::redis_support::drop_namespace(s.keys().namespace()).await;
                }
            )*
        }
        mod cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    let Some(cluster) = crate::cluster_support::LocalCluster::start().await else {
                        return;
                    };
                    let s = cluster.store(|c| c).await;
                    assert!(s.is_cluster());
                    super::$check(&s).await;
                }
            )*
        }
    };
}

contract!(
    create_and_idempotent_create,
    reads_split_commits_of_several_events,
    commit_is_compare_and_set,
    fencing,
    event_seq_is_gap_free,
    read_after_and_limit,
    active_index_follows_terminal,
    list_runs_isolation_filters_and_cursor,
    controls_inbox_keeps_order,
    epoch_marker_is_stable,
    racing_writers_one_wins_each_version,
    renew_returns_lost_leases,
    dead_owner_runs_fall_due_and_move_on,
    due_index_follows_release_and_set_due,
    dangling_due_entries_are_skipped,
    node_ids_are_held_by_one_instance,
    wakeups_block_time_out_and_deliver,
    client_key_retry_creates_the_missing_checkpoint,
    filtered_listings_follow_status_changes,
    transcript_is_append_only,
    create_claimed_owns_the_new_run,
    commit_final_gives_the_lease_up,
);

/// The URL factory opens each kind.
#[tokio::test]
async fn factory_opens_each_kind() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file:{}", dir.path().join("data").display());
    let s: SharedStore = agentd::store::open(&url).await.unwrap();
    created(&*s, "t1").await;
    assert!(dir.path().join("data").join("agentd.redb").exists());
    agentd::store::open("memory:")
        .await
        .unwrap()
        .ping()
        .await
        .unwrap();

    let Some(redis) = crate::redis_support::PrivateRedis::start().await else {
        return;
    };
    let s = agentd::store::open(&format!("{}?ns=factory-test", redis.url()))
        .await
        .unwrap();
    let run = created(&*s, "t1").await;
    // The namespace parameter reached the key layout.
    let client = ::redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let exists: bool = ::redis::cmd("EXISTS")
        .arg(format!("factory-test:{{run:{run}}}:ckpt"))
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(exists);
    let err = agentd::store::open("redis://127.0.0.1:6379/0?ns=bad:ns")
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("namespace"), "{err}");
}

/// Commits that must be refused (fenced, stale, a gap, a run never created) sent at the same
/// moment as good ones, so that they share group-commit batches: each caller gets its own
/// answer, and the good commits are stored whole.
async fn rejected_commits_do_not_disturb_their_batch<S: Store + 'static>(s: Arc<S>) {
    let mut leased = Vec::new();
    for _ in 0..100 {
        let run = created(&*s, "t1").await;
        let lease = s.claim(&run, "node-a", TTL).await.unwrap();
        leased.push((run, lease));
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (run, lease) in &leased {
        let good = ckpt(run, "t1", 2);
        let fenced = Lease {
            token: lease.token + 100,
            ..lease.clone()
        };
        let mut bad = ckpt(run, "t1", 3);
        bad.body = "{\"bad\":true}".into();
        let ghost = RunId::generate();
        let jobs: [(&str, Lease, Checkpoint, u64, Vec<_>); 5] = [
            ("good", lease.clone(), good, 1, vec![ev(2)]),
            ("fenced", fenced, bad.clone(), 1, vec![ev(2)]),
            ("stale", lease.clone(), bad.clone(), 0, vec![ev(1)]),
            ("gap", lease.clone(), bad.clone(), 1, vec![ev(3)]),
            (
                "ghost",
                lease.clone(),
                ckpt(&ghost, "t1", 2),
                1,
                vec![ev(2)],
            ),
        ];
        for (kind, l, c, expected, events) in jobs {
            let s = s.clone();
            tasks.spawn(async move { (kind, s.commit(&l, &c, expected, &events).await) });
        }
    }
    for (kind, r) in tasks.join_all().await {
        match kind {
            "good" => assert_eq!(r, Ok(())),
            "fenced" => assert!(matches!(r, Err(Error::Fenced { .. })), "{r:?}"),
            "stale" => assert!(matches!(r, Err(Error::VersionConflict { .. })), "{r:?}"),
            // Before the good commit the gap is seen, after it the version has moved on.
            "gap" => assert!(
                matches!(
                    r,
                    Err(Error::SequenceGap { .. } | Error::VersionConflict { .. })
                ),
                "{r:?}"
            ),
            _ => assert!(
                matches!(r, Err(Error::NotFound(_) | Error::Fenced { .. })),
                "{r:?}"
            ),
        }
    }
    let active: HashSet<RunId> = s.active_runs().await.unwrap().into_iter().collect();
    for (run, _) in &leased {
        assert_eq!(s.load(run).await.unwrap(), Some(ckpt(run, "t1", 2)));
        assert_eq!(s.read(run, 0, 10).await.unwrap(), vec![ev(1), ev(2)]);
        assert!(active.contains(run));
    }
}

mod file_store {
    use super::*;
    use agentd::store::file::FileStore;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn survives_reopen_and_tokens_never_go_back() {
        let dir = tempfile::tempdir().unwrap();
        let (run, token, epoch, last) = {
            let s = FileStore::open(dir.path()).await.unwrap();
            let run = created(&s, "t1").await;
            let lease = s.claim(&run, "node-a", TTL).await.unwrap();
            let c = s.load(&run).await.unwrap().unwrap();
            let last = step(&s, &lease, &c).await;
            s.push_control(&run, &Control::Input { text: "x".into() })
                .await
                .unwrap();
            (run, lease.token, s.epoch().await.unwrap(), last)
        };
        let s = FileStore::open(dir.path()).await.unwrap();
        assert_eq!(s.epoch().await.unwrap(), epoch);
        assert_eq!(s.load(&run).await.unwrap(), Some(last));
        assert_eq!(s.read(&run, 0, 10).await.unwrap().len(), 2);
        assert_eq!(s.controls(&run, 0).await.unwrap().len(), 1);
        assert_eq!(s.active_runs().await.unwrap(), vec![run.clone()]);
        // The old process's lease is void, but its token is not reused.
        let lease = s.claim(&run, "node-b", TTL).await.unwrap();
        assert!(lease.token > token);
        let old = Lease {
            run_id: run.clone(),
            owner: "node-a".into(),
            token,
        };
        let err = s.commit(&old, &ckpt(&run, "t1", 3), 2, &[ev(3)]).await;
        assert!(matches!(err, Err(Error::Fenced { .. })));
    }

    /// Group commit: many runs committing at once all succeed, each with its own versions and
    /// a gap-free log.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_runs_commit_concurrently_through_group_commit() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(FileStore::open(dir.path()).await.unwrap());
        super::redis_concurrency::drive(s, 300, 5, 100).await;
    }

    /// Many writers holding the same lease race on every version, all queued at once (so they
    /// share batches): exactly one wins each version, the others see the winner's version.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_racing_writers_one_wins_each_version() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(FileStore::open(dir.path()).await.unwrap());
        let run = created(&*s, "t1").await;
        let lease = s.claim(&run, "node-a", TTL).await.unwrap();
        for v in 1..=20u64 {
            let mut tasks = tokio::task::JoinSet::new();
            for w in 0..8 {
                let (s, run, lease) = (s.clone(), run.clone(), lease.clone());
                tasks.spawn(async move {
                    let mut c = ckpt(&run, "t1", v + 1);
                    c.body = format!("{{\"writer\":{w}}}");
                    (c.clone(), s.commit(&lease, &c, v, &[ev(v + 1)]).await)
                });
            }
            let results = tasks.join_all().await;
            let winners: Vec<_> = results.iter().filter(|(_, r)| r.is_ok()).collect();
            assert_eq!(winners.len(), 1, "version {v}: {results:?}");
            for (_, r) in &results {
                if let Err(e) = r {
                    assert!(
                        matches!(e, Error::VersionConflict { found, .. } if *found == v + 1),
                        "{e:?}"
                    );
                }
            }
            assert_eq!(s.load(&run).await.unwrap(), Some(winners[0].0.clone()));
        }
        assert_eq!(
            s.read(&run, 0, 100).await.unwrap(),
            (1..=21).map(ev).collect::<Vec<_>>()
        );
    }

    /// Rejected commits (fenced, stale, gapped, unknown run) queued together with good ones are
    /// their callers' errors only: every good commit lands, and nothing of a bad one does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rejected_commits_do_not_disturb_their_batch() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(FileStore::open(dir.path()).await.unwrap());
        super::rejected_commits_do_not_disturb_their_batch(s).await;
    }

    /// Creates, claims, releases and controls share the writer with commits and keep their
    /// rules when queued together.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn other_writes_share_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(FileStore::open(dir.path()).await.unwrap());
        let runs = ids(50);
        // Concurrent creates with one client key per pair of runs: one of each pair wins.
        let mut tasks = tokio::task::JoinSet::new();
        for (i, run) in runs.iter().enumerate() {
            let (s, run) = (s.clone(), run.clone());
            tasks.spawn(async move {
                let key = format!("k{}", i / 2);
                let out = s.create(&ckpt(&run, "t1", 1), &[ev(1)], Some(&key)).await;
                (i, run, out.unwrap())
            });
        }
        let mut made = Vec::new();
        for (i, run, out) in tasks.join_all().await {
            if out == CreateOutcome::Created {
                made.push((i, run));
            }
        }
        assert_eq!(made.len(), 25);
        // Concurrent claims by two owners: exactly one gets each run.
        let mut tasks = tokio::task::JoinSet::new();
        for (_, run) in &made {
            for owner in ["node-a", "node-b"] {
                let (s, run) = (s.clone(), run.clone());
                tasks.spawn(async move { s.claim(&run, owner, TTL).await });
            }
        }
        let claims = tasks.join_all().await;
        let leases: Vec<Lease> = claims.iter().filter_map(|r| r.clone().ok()).collect();
        assert_eq!(leases.len(), 25, "{claims:?}");
        assert!(
            claims
                .iter()
                .all(|r| matches!(r, Ok(_) | Err(Error::LeaseHeld { .. })))
        );
        // Controls pushed concurrently get gap-free seqs per run.
        let mut tasks = tokio::task::JoinSet::new();
        for (_, run) in &made {
            for n in 0..4 {
                let (s, run) = (s.clone(), run.clone());
                tasks.spawn(async move {
                    s.push_control(
                        &run,
                        &Control::Input {
                            text: n.to_string(),
                        },
                    )
                    .await
                    .unwrap()
                });
            }
        }
        tasks.join_all().await;
        for (_, run) in &made {
            let seqs: Vec<u64> = s
                .controls(run, 0)
                .await
                .unwrap()
                .iter()
                .map(|c| c.seq)
                .collect();
            assert_eq!(seqs, vec![1, 2, 3, 4]);
        }
        // Releases and re-claims in one go: the other owner gets each run with a larger token.
        let mut tasks = tokio::task::JoinSet::new();
        for l in &leases {
            let (s, l) = (s.clone(), l.clone());
            tasks.spawn(async move {
                s.release(&l).await.unwrap();
                let other = if l.owner == "node-a" {
                    "node-b"
                } else {
                    "node-a"
                };
                let next = s.claim(&l.run_id, other, TTL).await.unwrap();
                assert!(next.token > l.token);
                let err = s.commit(&l, &ckpt(&l.run_id, "t1", 2), 1, &[ev(2)]).await;
                assert!(matches!(err, Err(Error::Fenced { .. })), "{err:?}");
            });
        }
        tasks.join_all().await;
    }

    /// A full write queue answers `Unavailable` within its wait, and such a write is not applied.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_is_unavailable_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = agentd::store::file::FileConfig {
            queue_capacity: 1,
            max_batch: 1,
            queue_wait: Duration::from_millis(1),
            ..Default::default()
        };
        let s = Arc::new(FileStore::open_with(dir.path(), cfg).await.unwrap());
        let mut leased = Vec::new();
        for _ in 0..200 {
            let run = created(&*s, "t1").await;
            let lease = s.claim(&run, "node-a", TTL).await.unwrap();
            leased.push((run, lease));
        }
        let start = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for (run, lease) in &leased {
            let (s, run, lease) = (s.clone(), run.clone(), lease.clone());
            tasks.spawn(async move {
                let r = s.commit(&lease, &ckpt(&run, "t1", 2), 1, &[ev(2)]).await;
                (run, r)
            });
        }
        let results = tasks.join_all().await;
        assert!(start.elapsed() < Duration::from_secs(20));
        let mut full = 0;
        for (run, r) in results {
            match r {
                Ok(()) => assert_eq!(s.load(&run).await.unwrap().unwrap().version, 2),
                Err(Error::Unavailable(m)) if m.contains("queue full") => {
                    full += 1;
                    assert_eq!(s.load(&run).await.unwrap().unwrap().version, 1);
                    assert_eq!(s.read(&run, 0, 10).await.unwrap().len(), 1);
                }
                Err(e) => panic!("{e:?}"),
            }
        }
        assert!(
            full > 0,
            "200 commits at once never found the 1-slot queue full"
        );
    }

    /// Dropping the store ends the writer and closes the file: it opens again at once, with
    /// every answered write in it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn drop_closes_the_file_after_the_last_writes() {
        let dir = tempfile::tempdir().unwrap();
        let mut expect = Vec::new();
        for round in 0..3 {
            let s = Arc::new(FileStore::open(dir.path()).await.unwrap());
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..50 {
                let s = s.clone();
                tasks.spawn(async move { created(&*s, "t1").await });
            }
            expect.extend(tasks.join_all().await);
            for run in &expect {
                assert!(s.load(run).await.unwrap().is_some(), "round {round}");
            }
        }
    }

    #[tokio::test]
    async fn a_new_directory_gets_a_new_epoch() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ea = FileStore::open(a.path())
            .await
            .unwrap()
            .epoch()
            .await
            .unwrap();
        let eb = FileStore::open(b.path())
            .await
            .unwrap()
            .epoch()
            .await
            .unwrap();
        assert_ne!(ea, eb);
    }
}

mod redis_faults {
    use super::*;
    use crate::redis_support::PrivateRedis;
    use agentd::store::redis::{RedisConfig, RedisStore};

    const OP_TIMEOUT: Duration = Duration::from_secs(1);
    /// Slack over the op timeout for an operation to report failure.
    const BOUND: Duration = Duration::from_secs(3);

    async fn open(redis: &PrivateRedis) -> RedisStore {
        RedisStore::open(
            RedisConfig::new(redis.url())
                .namespace("faults")
                .op_timeout(OP_TIMEOUT),
        )
        .await
        .unwrap()
    }

    async fn assert_unavailable<T: std::fmt::Debug>(
        what: &str,
        f: impl std::future::Future<Output = agentd::store::Result<T>>,
    ) {
        let start = Instant::now();
        let r = f.await;
        let took = start.elapsed();
        assert!(
            matches!(r, Err(Error::Unavailable(_))),
            "{what}: expected Unavailable, got {r:?}"
        );
        assert!(took < BOUND, "{what}: took {took:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_down_is_unavailable_then_recovers_with_a_new_epoch() {
        let Some(mut redis) = PrivateRedis::start().await else {
            return;
        };
        let s = open(&redis).await;
        let epoch = s.epoch().await.unwrap();
        let run = created(&s, "t1").await;
        let lease = s.claim(&run, "node-a", TTL).await.unwrap();

        redis.kill();
        assert_unavailable("ping", s.ping()).await;
        assert_unavailable("load", s.load(&run)).await;
        assert_unavailable(
            "commit",
            s.commit(&lease, &ckpt(&run, "t1", 2), 1, &[ev(2)]),
        )
        .await;
        assert_unavailable("claim", s.claim(&run, "node-a", TTL)).await;
        assert_unavailable("read", s.read(&run, 0, 10)).await;

        // Redis comes back empty: the manager reconnects, and the epoch marker says the data is
        // gone.
        redis.restart().await;
        eventually(
            "the store to reconnect",
            Duration::from_secs(15),
            || async { s.ping().await.ok() },
        )
        .await;
        let after = s.epoch().await.unwrap();
        assert_ne!(after, epoch, "an empty Redis must show a new epoch");
        assert_eq!(s.load(&run).await.unwrap(), None);
        // Everything works again, scripts included (NOSCRIPT is handled).
        let run2 = created(&s, "t1").await;
        let lease2 = s.claim(&run2, "node-a", TTL).await.unwrap();
        let c = s.load(&run2).await.unwrap().unwrap();
        step(&s, &lease2, &c).await;
        assert_eq!(s.epoch().await.unwrap(), after);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hung_server_times_out_then_recovers() {
        let Some(redis) = PrivateRedis::start().await else {
            return;
        };
        let s = open(&redis).await;
        let run = created(&s, "t1").await;
        let lease = s.claim(&run, "node-a", TTL).await.unwrap();
        let epoch = s.epoch().await.unwrap();

        redis.signal("STOP");
        assert_unavailable("ping", s.ping()).await;
        assert_unavailable(
            "commit",
            s.commit(&lease, &ckpt(&run, "t1", 2), 1, &[ev(2)]),
        )
        .await;
        redis.signal("CONT");

        eventually(
            "the store to answer again",
            Duration::from_secs(15),
            || async { s.ping().await.ok() },
        )
        .await;
        // The timed-out commit may or may not have been applied: retrying it is safe.
        s.commit(&lease, &ckpt(&run, "t1", 2), 1, &[ev(2)])
            .await
            .unwrap();
        assert_eq!(s.read(&run, 0, 10).await.unwrap().len(), 2);
        assert_eq!(s.epoch().await.unwrap(), epoch, "same server, same epoch");
    }
}

/// Transient faults are `Unavailable` (retryable) within a bound, and the store recovers: a
/// cluster master killed and restarted, and a single Redis busy running a long script.
mod redis_transient_faults {
    use super::*;
    use crate::cluster_support::LocalCluster;
    use crate::redis_support::PrivateRedis;
    use agentd::store::redis::{RedisConfig, RedisStore};

    const BOUND: Duration = Duration::from_secs(4);

    async fn transient<T: std::fmt::Debug>(
        what: &str,
        f: impl std::future::Future<Output = agentd::store::Result<T>>,
    ) {
        let start = Instant::now();
        let r = f.await;
        let took = start.elapsed();
        match r {
            Err(e) => assert!(e.is_retryable(), "{what}: {e:?} should be retryable"),
            Ok(v) => panic!("{what}: expected a transient error, got {v:?}"),
        }
        assert!(took < BOUND, "{what}: took {took:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_master_down_is_retryable_then_recovers() {
        let Some(mut cluster) = LocalCluster::start().await else {
            return;
        };
        let s = cluster
            .store(|c| c.op_timeout(Duration::from_secs(1)))
            .await;
        // Enough runs that some live on every master.
        let mut runs = Vec::new();
        for _ in 0..30 {
            runs.push(created(&s, "t1").await);
        }
        cluster.kill(0);
        // Some run's slot is on the dead master: reading it fails, transiently, in bounds.
        let mut failed = None;
        for r in &runs {
            let start = Instant::now();
            let out = s.load(r).await;
            assert!(start.elapsed() < BOUND, "load took {:?}", start.elapsed());
            if let Err(e) = out {
                assert!(e.is_retryable(), "{e:?}");
                failed = Some(r.clone());
                break;
            }
        }
        let victim = failed.expect("no run lived on the killed master");
        transient("claim", s.claim(&victim, "node-a", TTL)).await;
        transient("renew", async {
            let lease = Lease {
                run_id: victim.clone(),
                owner: "node-a".into(),
                token: 1,
            };
            s.renew_leases("node-a", &[lease], TTL).await
        })
        .await;

        cluster.restart(0).await;
        // The master is back (empty: no persistence); the store works again on every slot.
        eventually(
            "the store to reach every master",
            Duration::from_secs(20),
            || async { s.load(&victim).await.ok() },
        )
        .await;
        let run = created(&s, "t1").await;
        let lease = s.claim(&run, "node-a", TTL).await.unwrap();
        let c = s.load(&run).await.unwrap().unwrap();
        step(&s, &lease, &c).await;
        let leases: Vec<Lease> = {
            let mut v = Vec::new();
            for r in &runs {
                if let Ok(l) = s.claim(r, "node-a", TTL).await {
                    v.push(l);
                }
            }
            v
        };
        assert!(!leases.is_empty());
        assert!(
            s.renew_leases("node-a", &leases, TTL)
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_redis_is_retryable_then_recovers() {
        let Some(redis) = PrivateRedis::start().await else {
            return;
        };
        let s = RedisStore::open(
            RedisConfig::new(redis.url())
                .namespace("busy")
                .op_timeout(Duration::from_secs(1)),
        )
        .await
        .unwrap();
        let run = created(&s, "t1").await;
        let client = ::redis::Client::open(redis.url()).unwrap();
        let mut admin = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = ::redis::cmd("CONFIG")
            .arg("SET")
            .arg("busy-reply-threshold")
            .arg(50)
            .query_async(&mut admin)
            .await
            .unwrap();
        // A script that keeps the server busy for 1.5 s; others get BUSY meanwhile.
        let hog = tokio::spawn(async move {
            let mut con = client.get_multiplexed_async_connection().await.unwrap();
            let _: ::redis::RedisResult<i64> = ::redis::cmd("EVAL")
                .arg(
                    "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] \
                     repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - s > 1500000 \
                     return 1",
                )
                .arg(0)
                .query_async(&mut con)
                .await;
        });
        let busy = eventually(
            "the server to answer BUSY",
            Duration::from_secs(5),
            || async {
                match s.load(&run).await {
                    Err(e) if e.to_string().contains("BUSY") => Some(e),
                    _ => None,
                }
            },
        )
        .await;
        assert!(busy.is_retryable(), "{busy:?}");
        hog.await.unwrap();
        eventually(
            "the store to answer again",
            Duration::from_secs(10),
            || async { s.load(&run).await.ok().flatten() },
        )
        .await;
    }
}

mod redis_concurrency {
    use super::*;
    use crate::redis_support::{drop_namespace, shared_redis};

    /// `runs` runs, each committing `commits` times, all concurrently. Returns commits/s.
    /// Shared with the file store's group-commit tests.
    pub(super) async fn drive<S: Store>(s: Arc<S>, runs: usize, commits: u64, body: usize) -> f64 {
        let mut setup = tokio::task::JoinSet::new();
        for _ in 0..runs {
            let s = s.clone();
            setup.spawn(async move {
                let run = created(&*s, "bench").await;
                let lease = s.claim(&run, "node-a", TTL).await.unwrap();
                (run, lease)
            });
        }
        let leased = setup.join_all().await;
        let start = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for (run, lease) in leased {
            let s = s.clone();
            tasks.spawn(async move {
                let mut c = ckpt(&run, "bench", 1);
                for _ in 0..commits {
                    let mut next = c.clone();
                    next.version += 1;
                    next.body = format!(
                        "{{\"v\":{},\"pad\":\"{}\"}}",
                        next.version,
                        "x".repeat(body)
                    );
                    s.commit(&lease, &next, c.version, &[ev(next.version)])
                        .await
                        .unwrap();
                    c = next;
                }
                (run, c.version)
            });
        }
        let done = tasks.join_all().await;
        let rate = (runs as u64 * commits) as f64 / start.elapsed().as_secs_f64();
        for (run, v) in &done {
            assert_eq!(*v, commits + 1);
            assert_eq!(s.load(run).await.unwrap().unwrap().version, commits + 1);
        }
        let (run, _) = &done[0];
        assert_eq!(
            s.read(run, 0, 1000).await.unwrap().len() as u64,
            commits + 1
        );
        rate
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rejected_commits_do_not_disturb_their_batch() {
        let Some(s) = shared_redis(|c| c).await else {
            return;
        };
        let ns = s.keys().namespace().to_owned();
        super::rejected_commits_do_not_disturb_their_batch(Arc::new(s)).await;
        drop_namespace(&ns).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_runs_commit_concurrently_through_group_commit() {
        let Some(s) = shared_redis(|c| c).await else {
            return;
        };
        let ns = s.keys().namespace().to_owned();
        drive(Arc::new(s), 200, 5, 100).await;
        drop_namespace(&ns).await;
    }

    /// Prints commits/s with and without group commit (set `STORE_BENCH_RUNS`, default 1000,
    /// `STORE_BENCH_COMMITS`, default 10, `STORE_BENCH_BODY` bytes of checkpoint body, default
    /// 2048). Figures only; nothing is asserted on timing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn throughput_figures() {
        let runs = std::env::var("STORE_BENCH_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        let commits = std::env::var("STORE_BENCH_COMMITS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10);
        let body = std::env::var("STORE_BENCH_BODY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2048);
        for group in [true, false] {
            let Some(s) = shared_redis(|c| c.group_commit(group)).await else {
                return;
            };
            let ns = s.keys().namespace().to_owned();
            let rate = drive(Arc::new(s), runs, commits, body).await;
            eprintln!(
                "redis store: {runs} runs x {commits} commits of {body} B bodies, \
                 group_commit={group}: {rate:.0} commits/s"
            );
            drop_namespace(&ns).await;
        }
        // One commit at a time: the round-trip bound.
        let Some(s) = shared_redis(|c| c.group_commit(false)).await else {
            return;
        };
        let run = created(&s, "bench").await;
        let lease = s.claim(&run, "node-a", TTL).await.unwrap();
        let mut c = ckpt(&run, "bench", 1);
        let n = 2000;
        let start = Instant::now();
        for _ in 0..n {
            c = step(&s, &lease, &c).await;
        }
        let rate = f64::from(n) / start.elapsed().as_secs_f64();
        eprintln!("redis store: 1 run x {n} sequential commits: {rate:.0} commits/s");
        drop_namespace(s.keys().namespace()).await;
    }
}

/// Prints how long a status-filtered listing takes among many runs of other statuses
/// (`LIST_BENCH_RUNS`, default 5000, 10 of them waiting), against reading every run of the
/// tenant (what a filtered listing cost before the indexes). Figures only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_figures() {
    let n: usize = std::env::var("LIST_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    async fn fill(s: &dyn Store, n: usize) {
        let body = "x".repeat(2048);
        for (i, r) in ids(n).iter().enumerate() {
            let mut c = ckpt(r, "bench", 1);
            c.body = body.clone();
            let waiting = i % (n / 10).max(1) == 0;
            c.status = if waiting {
                "waiting_approval"
            } else {
                "succeeded"
            }
            .into();
            c.terminal = !waiting;
            s.create(&c, &[ev(1)], None).await.unwrap();
        }
    }
    async fn median_ms(s: &dyn Store, filter: &RunFilter, limit: usize) -> (f64, usize) {
        let mut times = Vec::new();
        let mut len = 0;
        for _ in 0..7 {
            let t = Instant::now();
            len = s
                .list_runs("bench", filter, None, limit)
                .await
                .unwrap()
                .items
                .len();
            times.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        times.sort_by(f64::total_cmp);
        (times[3], len)
    }
    let waiting = RunFilter {
        status: Some("waiting_approval".into()),
        agent: None,
    };
    let dir = tempfile::tempdir().unwrap();
    let file = agentd::store::file::FileStore::open(dir.path())
        .await
        .unwrap();
    let redis = crate::redis_support::shared_redis(|c| c).await;
    let mut stores: Vec<(&str, &dyn Store)> = vec![("file", &file)];
    if let Some(r) = &redis {
        stores.push(("redis", r));
    }
    for (name, s) in stores {
        fill(s, n).await;
        let (filtered, found) = median_ms(s, &waiting, 50).await;
        let (all, read) = median_ms(s, &RunFilter::default(), n).await;
        eprintln!(
            "{name} store, {n} runs: status-filtered page ({found} found) median {filtered:.2} ms; \
             reading all {read} runs median {all:.2} ms"
        );
    }
    if let Some(r) = redis {
        crate::redis_support::drop_namespace(r.keys().namespace()).await;
    }
}

/// Redis and Redis Cluster only: the indexes no script touches.
mod redis_indexes {
    use super::*;
    use agentd::store::redis::RedisStore;

    async fn raw(s: &RedisStore, cmd: &mut ::redis::Cmd, url: &str) -> ::redis::Value {
        // A plain client on the same server (for a cluster, any node redirects us).
        if let Some(nodes) = url.strip_prefix("redis+cluster://") {
            let nodes: Vec<String> = nodes.split(',').map(|h| format!("redis://{h}")).collect();
            let client = ::redis::cluster::ClusterClient::new(nodes).unwrap();
            let mut con = client.get_async_connection().await.unwrap();
            return cmd.query_async(&mut con).await.unwrap();
        }
        let _ = s;
        let client = ::redis::Client::open(url).unwrap();
        let mut con = client.get_multiplexed_async_connection().await.unwrap();
        cmd.query_async(&mut con).await.unwrap()
    }

    /// An active-index entry that is not a run id at all is skipped, not an error: one bad
    /// record must not stop a daemon's start-up.
    async fn a_bad_active_entry_is_skipped(s: &RedisStore, url: &str) {
        let k = s.keys().clone();
        let live = created(s, "t1").await;
        raw(
            s,
            ::redis::cmd("SADD").arg(k.active()).arg("../not a run id"),
            url,
        )
        .await;
        let active = s.active_runs().await.unwrap();
        assert!(active.contains(&live), "{active:?}");
    }

    /// A record of the first layout (the whole checkpoint as one JSON `doc` field, as
    /// releases before the split wrote it) is listed and loaded as it was written; the load
    /// rewrites it in the current layout (constant `meta` once, `body` and the changing
    /// fields beside it), so the run's next commits send only what changes, and the run
    /// goes on: its commits land, it is listed and loaded with them, and a commit on a
    /// record still in the first layout is refused, not misapplied.
    async fn a_first_layout_record_is_read_and_upgraded(s: &RedisStore, url: &str) {
        let k = s.keys().clone();
        let tenant = format!("t-{}", uuid::Uuid::new_v4().simple());
        let [run, other] = <[RunId; 2]>::try_from(ids(2)).unwrap();
        let mut legacy = ckpt(&run, &tenant, 1);
        legacy.status = "waiting_approval".into();
        legacy.body = "{\"format_version\":4,\"say\":\"it is \\\"quoted\\\"\"}".into();
        for r in [&run, &other] {
            let mut c = legacy.clone();
            c.run_id = r.clone();
            s.create(&c, &[ev(1)], None).await.unwrap();
            // As the first layout left it: one `doc` with the whole checkpoint.
            raw(
                s,
                ::redis::cmd("HDEL")
                    .arg(k.ckpt(r))
                    .arg("meta")
                    .arg("body")
                    .arg("u"),
                url,
            )
            .await;
            raw(
                s,
                ::redis::cmd("HSET")
                    .arg(k.ckpt(r))
                    .arg("doc")
                    .arg(serde_json::to_string(&c).unwrap()),
                url,
            )
            .await;
        }
        let waiting = RunFilter {
            status: Some("waiting_approval".into()),
            agent: None,
        };
        let page = s.list_runs(&tenant, &waiting, None, 10).await.unwrap();
        assert_eq!(page.items.len(), 2, "{:?}", page.unreadable);
        assert!(
            page.items
                .iter()
                .any(|c| c.run_id == run && c.body == legacy.body)
        );

        // A commit on a record nobody loaded since the upgrade is refused as corrupt.
        let lease = s.claim(&other, "n1", TTL).await.unwrap();
        let mut next = legacy.clone();
        next.run_id = other.clone();
        next.version = 2;
        let refused = s.commit(&lease, &next, 1, &[ev(2)]).await.unwrap_err();
        assert!(matches!(refused, Error::Corrupt(_)), "{refused:?}");

        let loaded = s.load(&run).await.unwrap().expect("stored");
        assert_eq!(loaded, legacy);
        let fields: Vec<Option<String>> = ::redis::from_redis_value(
            raw(
                s,
                ::redis::cmd("HMGET")
                    .arg(k.ckpt(&run))
                    .arg("doc")
                    .arg("meta")
                    .arg("body"),
                url,
            )
            .await,
        )
        .unwrap();
        assert_eq!(fields[0], None, "the first layout's doc is gone");
        assert!(fields[1].as_deref().is_some_and(|m| m.contains(&tenant)));
        assert_eq!(fields[2].as_deref(), Some(legacy.body.as_str()));

        let lease = s.claim(&run, "n1", TTL).await.unwrap();
        let mut next = loaded.clone();
        next.version = 2;
        next.status = "succeeded".into();
        next.terminal = true;
        next.updated_at_ms += 5;
        next.body = "{\"format_version\":4,\"done\":true}".into();
        s.commit(&lease, &next, 1, &[ev(2)]).await.unwrap();
        assert_eq!(s.load(&run).await.unwrap(), Some(next.clone()));
        let done = RunFilter {
            status: Some("succeeded".into()),
            agent: None,
        };
        let page = s.list_runs(&tenant, &done, None, 10).await.unwrap();
        assert_eq!(page.items, vec![next]);
    }

    /// A filtered listing reads only the runs its index selects: a run in another status
    /// whose record is unreadable is not even read (an unfiltered listing reports it and
    /// serves the rest). A namespace written before the indexes existed gets them at its
    /// first filtered listing.
    async fn filtered_listings_read_only_their_index(s: &RedisStore, url: &str) {
        let k = s.keys().clone();
        let tenant = format!("t-{}", uuid::Uuid::new_v4().simple());
        let runs = ids(4);
        for (i, r) in runs.iter().enumerate() {
            let mut c = ckpt(r, &tenant, 1);
            c.status = if i == 0 {
                "succeeded"
            } else {
                "waiting_approval"
            }
            .into();
            c.terminal = i == 0;
            c.agent = if i == 3 { "triage" } else { "demo" }.into();
            s.create(&c, &[ev(1)], None).await.unwrap();
        }
        raw(
            s,
            ::redis::cmd("HSET")
                .arg(k.ckpt(&runs[0]))
                .arg("meta")
                .arg("{not json"),
            url,
        )
        .await;
        let waiting = RunFilter {
            status: Some("waiting_approval".into()),
            agent: None,
        };
        let page = s.list_runs(&tenant, &waiting, None, 10).await.unwrap();
        let got: Vec<RunId> = page.items.iter().map(|c| c.run_id.clone()).collect();
        assert_eq!(got, vec![runs[3].clone(), runs[2].clone(), runs[1].clone()]);
        assert!(page.unreadable.is_empty(), "{:?}", page.unreadable);
        let all = s
            .list_runs(&tenant, &RunFilter::default(), None, 10)
            .await
            .unwrap();
        assert_eq!(all.items.len(), 3);
        assert_eq!(all.unreadable.len(), 1);
        assert_eq!(all.unreadable[0].0, runs[0]);

        // As an earlier version left it: no status or agent index, no marker. A new store
        // (another process) builds them on its first filtered listing.
        for key in [
            k.tenant_status_runs(&tenant, "waiting_approval"),
            k.tenant_status_runs(&tenant, "succeeded"),
            k.tenant_agent_runs(&tenant, "demo"),
            k.tenant_agent_runs(&tenant, "triage"),
            k.tenant_list_indexed(&tenant),
        ] {
            raw(s, ::redis::cmd("DEL").arg(key), url).await;
        }
        let fresh = RedisStore::open(
            agentd::store::redis::RedisConfig::new(url)
                .namespace(k.namespace())
                .op_timeout(Duration::from_secs(5)),
        )
        .await
        .unwrap();
        let page = fresh.list_runs(&tenant, &waiting, None, 10).await.unwrap();
        let got: Vec<RunId> = page.items.iter().map(|c| c.run_id.clone()).collect();
        assert_eq!(got, vec![runs[3].clone(), runs[2].clone(), runs[1].clone()]);
        let triage = RunFilter {
            status: None,
            agent: Some("triage".into()),
        };
        let page = fresh.list_runs(&tenant, &triage, None, 10).await.unwrap();
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].run_id, runs[3]);
    }

    /// Index entries for runs that never got a checkpoint (their creator crashed between the
    /// index write and the create) are skipped and removed when old; a client key that maps to
    /// such a run answers `Existing`, and creating that run with the key writes it.
    async fn dangling_entries_and_orphan_client_keys(s: &RedisStore, url: &str) {
        let k = s.keys().clone();
        let tenant = format!("t-{}", uuid::Uuid::new_v4().simple());
        let live = created(s, &tenant).await;
        let ghost = ancient_id();
        raw(
            s,
            ::redis::cmd("SADD").arg(k.active()).arg(ghost.as_str()),
            url,
        )
        .await;
        raw(
            s,
            ::redis::cmd("ZADD")
                .arg(k.tenant_runs(&tenant))
                .arg(0)
                .arg(ghost.as_str()),
            url,
        )
        .await;
        let active = s.active_runs().await.unwrap();
        assert!(active.contains(&live) && !active.contains(&ghost));
        let page = s
            .list_runs(&tenant, &RunFilter::default(), None, 10)
            .await
            .unwrap();
        assert_eq!(
            page.items
                .iter()
                .map(|c| c.run_id.clone())
                .collect::<Vec<_>>(),
            vec![live.clone()]
        );
        let in_active = raw(
            s,
            ::redis::cmd("SISMEMBER")
                .arg(k.active())
                .arg(ghost.as_str()),
            url,
        )
        .await;
        assert_eq!(in_active, ::redis::Value::Int(0), "cleaned from active");
        let in_tenant = raw(
            s,
            ::redis::cmd("ZSCORE")
                .arg(k.tenant_runs(&tenant))
                .arg(ghost.as_str()),
            url,
        )
        .await;
        assert_eq!(
            in_tenant,
            ::redis::Value::Nil,
            "cleaned from the tenant index"
        );

        // A client key whose run was never written.
        let orphan = RunId::generate();
        raw(
            s,
            ::redis::cmd("SET")
                .arg(k.client_key(&tenant, "ck"))
                .arg(orphan.as_str()),
            url,
        )
        .await;
        let other = RunId::generate();
        assert_eq!(
            s.create(&ckpt(&other, &tenant, 1), &[ev(1)], Some("ck"))
                .await
                .unwrap(),
            CreateOutcome::Existing(orphan.clone())
        );
        assert_eq!(s.load(&orphan).await.unwrap(), None);
        assert_eq!(
            s.create(&ckpt(&orphan, &tenant, 1), &[ev(1)], Some("ck"))
                .await
                .unwrap(),
            CreateOutcome::Created
        );
        assert!(s.load(&orphan).await.unwrap().is_some());
        assert!(s.active_runs().await.unwrap().contains(&orphan));
        assert_eq!(s.load(&other).await.unwrap(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn single() {
        let Some(s) = crate::redis_support::shared_redis(|c| c).await else {
            return;
        };
        dangling_entries_and_orphan_client_keys(&s, &crate::redis_support::shared_redis_url())
            .await;
        a_bad_active_entry_is_skipped(&s, &crate::redis_support::shared_redis_url()).await;
        a_first_layout_record_is_read_and_upgraded(&s, &crate::redis_support::shared_redis_url())
            .await;
        filtered_listings_read_only_their_index(&s, &crate::redis_support::shared_redis_url())
            .await;
        crate::redis_support::drop_namespace(s.keys().namespace()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster() {
        let Some(cluster) = crate::cluster_support::LocalCluster::start().await else {
            return;
        };
        let s = cluster.store(|c| c).await;
        dangling_entries_and_orphan_client_keys(&s, &cluster.url()).await;
        a_bad_active_entry_is_skipped(&s, &cluster.url()).await;
        a_first_layout_record_is_read_and_upgraded(&s, &cluster.url()).await;
        filtered_listings_read_only_their_index(&s, &cluster.url()).await;
    }

    /// Commits on a cluster: many runs committing at once, each with its own versions
    /// and a gap-free log.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster_concurrent_commits() {
        let Some(cluster) = crate::cluster_support::LocalCluster::start().await else {
            return;
        };
        let s = cluster.store(|c| c).await;
        super::redis_concurrency::drive(Arc::new(s), 200, 5, 100).await;
    }
}

/// Commits/s on a local three-master cluster (same knobs as
/// `redis_concurrency::throughput_figures`; defaults 500 runs x 10 commits of 2048 B). On a
/// cluster commits go out directly, concurrent ones sharing the per-node connections. Figures
/// only; nothing is asserted on timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_throughput_figures() {
    let var = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (runs, commits, body) = (
        var("STORE_BENCH_RUNS", 500),
        var("STORE_BENCH_COMMITS", 10) as u64,
        var("STORE_BENCH_BODY", 2048),
    );
    let Some(cluster) = crate::cluster_support::LocalCluster::start().await else {
        return;
    };
    let s = cluster.store(|c| c).await;
    let rate = redis_concurrency::drive(Arc::new(s), runs, commits, body).await;
    eprintln!(
        "redis cluster store (3 masters): {runs} runs x {commits} commits of {body} B bodies: \
         {rate:.0} commits/s"
    );
}

/// Lease renewal: one script per lease plus one ZADD per call, in one round trip; and the
/// figures for the notes (commands per second per 1,000 live runs, time of one renewal of
/// 1,000 leases) on a private single Redis and on a local cluster. Set `RENEW_BENCH_LEASES`
/// (default 1000) and `RENEW_BENCH_ROUNDS` (default 20). Figures only; nothing is asserted on
/// timing.
mod renewal_figures {
    use super::*;
    use crate::cluster_support::{LocalCluster, commandstats_calls};
    use crate::redis_support::PrivateRedis;
    use agentd::store::redis::{RedisConfig, RedisStore};

    fn env(name: &str, default: usize) -> usize {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    async fn leased(s: &RedisStore, n: usize) -> Vec<Lease> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let run = created(s, "bench").await;
            out.push(s.claim(&run, "node-a", TTL).await.unwrap());
        }
        out
    }

    /// Renews `leases` `rounds` times; returns (median, max) of one call, and checks nothing
    /// was lost.
    async fn time_renewals(
        s: &RedisStore,
        leases: &[Lease],
        rounds: usize,
    ) -> (Duration, Duration) {
        let mut times = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            let lost = s.renew_leases("node-a", leases, TTL).await.unwrap();
            times.push(start.elapsed());
            assert!(lost.is_empty(), "{lost:?}");
        }
        times.sort();
        (times[times.len() / 2], times[times.len() - 1])
    }

    fn report(kind: &str, n: usize, calls: (u64, u64), times: (Duration, Duration)) {
        // Renewal every ttl/3: per second, (commands per call) / (ttl/3), per 1,000 runs.
        let per_call = calls.0 + calls.1;
        let interval = TTL.as_secs_f64() / 3.0;
        let per_sec_per_1000 = per_call as f64 / interval * 1000.0 / n as f64;
        eprintln!(
            "renewal on {kind}: {n} leases -> {} EVALSHA + {} ZADD per call; ttl {:?}, every \
             ttl/3: {per_sec_per_1000:.0} commands/s per 1,000 live runs; one call: median \
             {:?}, max {:?}",
            calls.0, calls.1, TTL, times.0, times.1
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn single_redis() {
        let Some(redis) = PrivateRedis::start().await else {
            return;
        };
        let n = env("RENEW_BENCH_LEASES", 1000);
        let rounds = env("RENEW_BENCH_ROUNDS", 20);
        let s = RedisStore::open(RedisConfig::new(redis.url()).namespace("renew"))
            .await
            .unwrap();
        let leases = leased(&s, n).await;
        let stats = || {
            let out = Command::new("redis-cli")
                .arg("-s")
                .arg(redis.socket())
                .args(["info", "commandstats"])
                .output()
                .unwrap();
            let info = String::from_utf8_lossy(&out.stdout).into_owned();
            (
                commandstats_calls(&info, "evalsha"),
                commandstats_calls(&info, "zadd"),
            )
        };
        let before = stats();
        s.renew_leases("node-a", &leases, TTL).await.unwrap();
        let after = stats();
        let calls = (after.0 - before.0, after.1 - before.1);
        assert_eq!(
            calls,
            (n as u64, 1),
            "one script per lease, one ZADD per call"
        );
        report(
            "single Redis",
            n,
            calls,
            time_renewals(&s, &leases, rounds).await,
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster() {
        let Some(cluster) = LocalCluster::start().await else {
            return;
        };
        let n = env("RENEW_BENCH_LEASES", 1000);
        let rounds = env("RENEW_BENCH_ROUNDS", 20);
        let s = cluster.store(|c| c).await;
        let leases = leased(&s, n).await;
        let stats = || {
            (
                cluster.command_calls("evalsha"),
                cluster.command_calls("zadd"),
            )
        };
        let before = stats();
        s.renew_leases("node-a", &leases, TTL).await.unwrap();
        let after = stats();
        let calls = (after.0 - before.0, after.1 - before.1);
        assert_eq!(
            calls,
            (n as u64, 1),
            "one script per lease, one ZADD per call"
        );
        report(
            "a 3-master cluster",
            n,
            calls,
            time_renewals(&s, &leases, rounds).await,
        );
    }

    use std::process::Command;
}
