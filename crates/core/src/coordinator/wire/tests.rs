use proptest::prelude::*;

use super::*;
use crate::coordinator::message::Message;

fn report(key: &str, i: u64) -> KeyReport {
    KeyReport {
        key: key.to_owned(),
        demand: 10.5 + i as f32,
        want: (i % 3 == 0).then_some(12.345),
        release: (i % 2 == 0).then_some(1_000_000 + i),
        held: (i % 5 == 0).then_some(1.0 / 3.0),
        freed: i % 7 == 0,
    }
}

fn exchange(keys: &[&str]) -> Exchange {
    Exchange {
        from: RegionId(2),
        incarnation: 1_765_000_000_000,
        to_incarnation: 1_765_000_000_001,
        t_req: 123_456_789,
        policies: vec![PolicyReport {
            name: "api".into(),
            applied: 3,
            keys: keys
                .iter()
                .enumerate()
                .map(|(i, k)| report(k, i as u64))
                .collect(),
        }],
    }
}

fn reply_to(ex: &Exchange, every: usize) -> ExchangeReply {
    ExchangeReply {
        from: RegionId(0),
        incarnation: 7,
        to_incarnation: ex.incarnation,
        t_req: ex.t_req,
        lease_us: 2_000_000,
        policies: ex
            .policies
            .iter()
            .map(|p| PolicyReply {
                name: p.name.clone(),
                applied: p.applied,
                keys: p
                    .keys
                    .iter()
                    .step_by(every)
                    .enumerate()
                    .map(|(i, k)| KeyReply {
                        key: k.key.clone(),
                        demand: 3.25,
                        grant: (i % 2 == 0).then_some(Grant {
                            seq: 900 + i as u64,
                            amount: if i % 4 == 0 { 0.1 } else { 2.0 / 3.0 },
                        }),
                    })
                    .collect(),
            })
            .collect(),
    }
}

#[test]
fn an_exchange_decodes_to_what_was_encoded() {
    let ex = exchange(&["a", "b", "customer-123", "ü"]);
    let (mut ids, mut table) = (KeyIds::new(100), KeyTable::new(100));
    let (bytes, _) = ids.encode(&ex);
    assert!(is_binary(&bytes));
    assert_eq!(table.decode(&bytes), Ok(ex));
}

#[test]
fn a_key_is_spelled_out_until_a_reply_confirms_it_then_sent_as_a_number() {
    let ex = exchange(&["customer-000001", "customer-000002"]);
    let (mut ids, mut table) = (KeyIds::new(100), KeyTable::new(100));
    let (first, spelled) = ids.encode(&ex);
    let (again, _) = ids.encode(&ex);
    assert_eq!(first, again, "unconfirmed keys are spelled out again");
    assert_eq!(table.decode(&first), Ok(ex.clone()));
    ids.confirm(&spelled);
    let (short, _) = ids.encode(&ex);
    assert!(
        short.len() + 2 * 15 <= first.len(),
        "{} vs {}",
        short.len(),
        first.len()
    );
    assert_eq!(table.decode(&short), Ok(ex.clone()));
    assert_eq!(
        table.decode(&again),
        Ok(ex),
        "spelling a key out again is harmless"
    );
    assert_eq!((ids.len(), table.len()), (2, 2));
}

#[test]
fn a_receiver_that_lost_its_table_refuses_numbers_and_the_sender_starts_over() {
    let ex = exchange(&["k1", "k2"]);
    let mut ids = KeyIds::new(100);
    let (first, spelled) = ids.encode(&ex);
    KeyTable::new(100).decode(&first).unwrap();
    ids.confirm(&spelled);
    let (numbers, _) = ids.encode(&ex);
    let mut restarted = KeyTable::new(100);
    let err = restarted.decode(&numbers).unwrap_err();
    assert_eq!(err, WireError::UnknownKey);
    assert!(err.is_dictionary());
    ids.refused(exchange_epoch(&numbers).unwrap());
    let (spelled_again, _) = ids.encode(&ex);
    assert_eq!(restarted.decode(&spelled_again), Ok(ex));
}

#[test]
fn a_refusal_of_an_older_epoch_leaves_the_current_one_alone() {
    let ex = exchange(&["k1"]);
    let mut ids = KeyIds::new(100);
    let (old, _) = ids.encode(&ex);
    ids.reset();
    let (_, spelled) = ids.encode(&ex);
    ids.confirm(&spelled);
    ids.refused(exchange_epoch(&old).unwrap());
    let (now, _) = ids.encode(&ex);
    assert_eq!(exchange_epoch(&now), Some(2));
    assert_eq!(ids.len(), 1);
}

#[test]
fn a_message_of_an_older_epoch_is_refused_and_leaves_the_table_as_it_was() {
    let ex = exchange(&["k1"]);
    let mut ids = KeyIds::new(100);
    let (old, _) = ids.encode(&ex);
    ids.reset();
    let (new, _) = ids.encode(&ex);
    let mut table = KeyTable::new(100);
    table.decode(&new).unwrap();
    assert_eq!(table.decode(&old), Err(WireError::StaleDictionary));
    assert_eq!(table.len(), 1);
}

#[test]
fn a_dictionary_starts_over_before_it_passes_its_cap() {
    let mut ids = KeyIds::new(3);
    let mut table = KeyTable::new(3);
    for round in 0..4 {
        let keys: Vec<String> = (0..2).map(|i| format!("r{round}-{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ex = exchange(&refs);
        let (bytes, spelled) = ids.encode(&ex);
        assert_eq!(table.decode(&bytes), Ok(ex));
        ids.confirm(&spelled);
        assert!(ids.len() <= 3 && table.len() <= 3);
    }
    assert!(ids.epoch() > 1);
}

#[test]
fn a_number_past_the_receivers_cap_is_refused() {
    let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let (bytes, _) = KeyIds::new(100).encode(&exchange(&refs));
    assert_eq!(
        KeyTable::new(4).decode(&bytes),
        Err(WireError::DictionaryFull)
    );
}

#[test]
fn a_reply_names_its_keys_by_position_in_the_request() {
    let ex = exchange(&["a", "b", "c", "d", "e"]);
    for every in [1, 2, 3] {
        let reply = reply_to(&ex, every);
        let bytes = encode_reply(&ex, &reply).unwrap();
        assert_eq!(decode_reply(&ex, &bytes), Ok(reply));
    }
}

#[test]
fn a_reply_that_does_not_follow_its_request_is_not_encoded() {
    let ex = exchange(&["a", "b"]);
    let mut reply = reply_to(&ex, 1);
    reply.policies[0].keys.reverse();
    assert_eq!(encode_reply(&ex, &reply), None);
    reply.policies[0].name = "other".into();
    assert_eq!(encode_reply(&ex, &reply), None);
}

#[test]
fn a_reply_that_points_past_its_request_is_refused() {
    let long = exchange(&["a", "b", "c"]);
    let bytes = encode_reply(&long, &reply_to(&long, 1)).unwrap();
    let short = exchange(&["a"]);
    assert_eq!(decode_reply(&short, &bytes), Err(WireError::NotTheRequest));
}

#[test]
fn json_and_binary_bodies_are_told_apart_by_their_first_byte() {
    let ex = exchange(&["a"]);
    let json = Message::Exchange(ex.clone()).encode();
    assert!(!is_binary(&json));
    assert!(!is_binary(&serde_json::to_vec(&ex).unwrap()));
    assert_eq!(
        KeyTable::new(10).decode(&serde_json::to_vec(&ex).unwrap()),
        Err(WireError::NotBinary)
    );
}

#[test]
fn an_unknown_version_is_refused_by_name() {
    let (mut bytes, _) = KeyIds::new(10).encode(&exchange(&["a"]));
    bytes[1] = 9;
    assert_eq!(
        KeyTable::new(10).decode(&bytes),
        Err(WireError::UnknownVersion(9))
    );
}

/// What the bandwidth target is about: a hot key with a loan, once its number is
/// confirmed, in an exchange and its reply.
#[test]
fn a_confirmed_leased_key_costs_under_forty_bytes_a_round_both_ways() {
    let keys: Vec<String> = (0..1000).map(|i| format!("customer-{i:08}")).collect();
    let mut ex = exchange(&keys.iter().map(String::as_str).collect::<Vec<_>>());
    for (i, k) in ex.policies[0].keys.iter_mut().enumerate() {
        k.want = Some(12.345 + i as f64);
        k.release = Some(5_000_000 + 2 * i as u64);
        k.held = None;
        k.freed = false;
    }
    let mut ids = KeyIds::new(10_000);
    let (_, spelled) = ids.encode(&ex);
    ids.confirm(&spelled);
    let (bytes, _) = ids.encode(&ex);
    let mut reply = reply_to(&ex, 1);
    for k in &mut reply.policies[0].keys {
        k.grant = Some(Grant {
            seq: 6_000_000 + k.key.len() as u64,
            amount: 12.345,
        });
    }
    let back = encode_reply(&ex, &reply).unwrap();
    let per_key = (bytes.len() + back.len()) as f64 / 1000.0;
    assert!(per_key < 40.0, "{per_key} bytes per key");
}

fn key_report() -> impl Strategy<Value = KeyReport> {
    (
        "[a-z0-9:-]{1,20}",
        any::<f32>(),
        proptest::option::of(prop_oneof![
            any::<f64>(),
            (0u64..10_000_000).prop_map(|m| m as f64 / 1000.0)
        ]),
        proptest::option::of(0u64..(1 << 53)),
        proptest::option::of(any::<f64>()),
        any::<bool>(),
    )
        .prop_map(|(key, demand, want, release, held, freed)| KeyReport {
            key,
            demand,
            want,
            release,
            held,
            freed,
        })
}

fn any_exchange() -> impl Strategy<Value = Exchange> {
    (
        any::<u16>(),
        0u64..(1 << 53),
        0u64..(1 << 53),
        any::<i64>(),
        proptest::collection::vec(
            (
                "[a-z]{1,8}",
                any::<u64>(),
                proptest::collection::vec(key_report(), 0..12),
            ),
            0..3,
        ),
    )
        .prop_map(
            |(from, incarnation, to_incarnation, t_req, policies)| Exchange {
                from: RegionId(from),
                incarnation,
                to_incarnation,
                t_req,
                policies: policies
                    .into_iter()
                    .map(|(name, applied, keys)| PolicyReport {
                        name,
                        applied,
                        keys,
                    })
                    .collect(),
            },
        )
}

/// NaN demand or amounts compare unequal: compare the encodings of both instead.
fn same(a: &Exchange, b: &Exchange) -> bool {
    serde_json::to_string(a).unwrap() == serde_json::to_string(b).unwrap()
}

proptest! {
    #[test]
    fn any_exchange_survives_the_round_trip_in_every_round(ex in any_exchange(), confirm in any::<bool>()) {
        let (mut ids, mut table) = (KeyIds::new(1000), KeyTable::new(1000));
        for _ in 0..3 {
            let (bytes, spelled) = ids.encode(&ex);
            let back = table.decode(&bytes).unwrap();
            prop_assert!(same(&back, &ex), "{back:?} != {ex:?}");
            if confirm {
                ids.confirm(&spelled);
            }
        }
    }

    #[test]
    fn garbage_never_panics_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..200), header in any::<bool>()) {
        let mut body = bytes;
        if header {
            body.splice(0..0, [MAGIC, VERSION, 1]);
        }
        let _ = KeyTable::new(100).decode(&body);
        let ex = exchange(&["a", "b"]);
        if header {
            body[2] = 2;
        }
        let _ = decode_reply(&ex, &body);
    }
}
