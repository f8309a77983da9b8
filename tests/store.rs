//! The TCP store end to end: our client against our server over loopback, raw sockets playing
//! PyTorch's client and hostile peers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use symmem::Error;
use symmem::store::{
    AsyncStoreClient, ClientOptions, MemoryStore, PrefixStore, Secret, ServerOptions, Store, StoreServer, TcpStore,
};
use symmem::wire::store::{Request, VALIDATION_MAGIC};

fn server() -> StoreServer {
    StoreServer::start("127.0.0.1:0", ServerOptions::default()).unwrap()
}

fn quick() -> ClientOptions {
    ClientOptions { timeout: Duration::from_secs(10), secret: None }
}

fn client(s: &StoreServer) -> TcpStore {
    TcpStore::connect(&s.local_addr().to_string(), quick()).unwrap()
}

/// Runs the same checks against any store: the TCP client and the in-process store must agree.
fn every_operation(store: &dyn Store) {
    store.set("k1", b"v1").unwrap();
    assert_eq!(store.get("k1").unwrap(), b"v1");
    store.set("k1", b"v2").unwrap();
    assert_eq!(store.get("k1").unwrap(), b"v2", "set overwrites");

    assert_eq!(store.add("cnt", 7).unwrap(), 7);
    assert_eq!(store.add("cnt", -10).unwrap(), -3);
    assert_eq!(store.get("cnt").unwrap(), b"-3", "add stores ASCII decimal");

    // compare_set, the four cases of torch's server.
    assert_eq!(store.compare_set("cs", b"x", b"y").unwrap(), b"x", "absent, non-empty expected");
    assert!(!store.check(&["cs"]).unwrap());
    assert_eq!(store.compare_set("cs", b"", b"first").unwrap(), b"first", "absent, empty expected");
    assert_eq!(store.compare_set("cs", b"nope", b"second").unwrap(), b"first", "mismatch");
    assert_eq!(store.compare_set("cs", b"first", b"second").unwrap(), b"second", "match");

    assert!(store.check(&["k1", "cnt"]).unwrap());
    assert!(!store.check(&["k1", "missing"]).unwrap());
    assert!(store.check(&[]).unwrap());

    store.append("log", b"ab").unwrap();
    store.append("log", b"cd").unwrap();
    assert_eq!(store.get("log").unwrap(), b"abcd");

    store.multi_set(&[("m1", b"1"), ("m2", b""), ("m3", b"333")]).unwrap();
    assert_eq!(store.multi_get(&["m3", "m1", "m2"]).unwrap(), vec![b"333".to_vec(), b"1".to_vec(), vec![]]);
    assert_eq!(store.multi_get(&[]).unwrap(), Vec::<Vec<u8>>::new());

    let n = store.num_keys().unwrap();
    assert!(store.delete("m2").unwrap());
    assert!(!store.delete("m2").unwrap());
    assert_eq!(store.num_keys().unwrap(), n - 1);

    store.wait(&["k1", "m1"]).unwrap();
    let t = Instant::now();
    let err = store.wait_timeout(&["k1", "never"], Duration::from_millis(100)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(t.elapsed() >= Duration::from_millis(100) && t.elapsed() < Duration::from_secs(5));
    assert!(store.get_timeout("never", Duration::from_millis(50)).unwrap_err().is_timeout());
    assert!(store.multi_get_timeout(&["k1", "never"], Duration::from_millis(50)).unwrap_err().is_timeout());
    // Still usable after timeouts.
    assert_eq!(store.get("k1").unwrap(), b"v2");

    // A barrier member's arrival: delete, set and wait in one round trip.
    store.set("b/0/1", b"").unwrap();
    store.set("b/old", b"").unwrap();
    store.arrive_and_wait(&["b/old", "b/absent"], "b/0/0", &["b/0/0", "b/0/1"], Duration::from_secs(5)).unwrap();
    assert!(store.check(&["b/0/0"]).unwrap() && !store.check(&["b/old"]).unwrap());
    let err = store.arrive_and_wait(&[], "b/1/0", &["b/1/0", "b/1/1"], Duration::from_millis(100)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(store.check(&["b/1/0"]).unwrap(), "the arrival was set before the wait");
    assert_eq!(store.get("k1").unwrap(), b"v2", "usable after a timed-out arrival");

    // Several deletions at once; absent keys are skipped, the others go, the rest stays.
    store.multi_set(&[("d/1", b"1"), ("d/2", b"2"), ("d/3", b"3")]).unwrap();
    store.delete_many(&["d/1", "d/absent", "d/3"]).unwrap();
    assert!(!store.check(&["d/1"]).unwrap() && !store.check(&["d/3"]).unwrap());
    assert_eq!(store.get("d/2").unwrap(), b"2");
    store.delete_many(&[]).unwrap();
    assert_eq!(store.get("k1").unwrap(), b"v2", "usable after deleting many");

    // Values are arbitrary bytes.
    let bin: Vec<u8> = (0..=255).collect();
    store.set("bin", &bin).unwrap();
    assert_eq!(store.get("bin").unwrap(), bin);
}

#[test]
fn tcp_store_supports_every_operation() {
    let s = server();
    every_operation(&client(&s));
}

#[test]
fn memory_store_matches_tcp_store() {
    every_operation(&MemoryStore::with_timeout(Duration::from_secs(10)));
}

#[test]
fn prefix_store_scopes_keys() {
    let s = server();
    let base: Arc<dyn Store> = Arc::new(client(&s));
    let a = PrefixStore::new("a", base.clone());
    let b = PrefixStore::new("b", base.clone());
    a.set("x", b"from a").unwrap();
    b.set("x", b"from b").unwrap();
    assert_eq!(a.get("x").unwrap(), b"from a");
    assert_eq!(base.get("b/x").unwrap(), b"from b");
    a.multi_set(&[("y", b"1"), ("z", b"2")]).unwrap();
    assert_eq!(base.multi_get(&["a/y", "a/z"]).unwrap(), vec![b"1".to_vec(), b"2".to_vec()]);
    assert!(!b.check(&["y"]).unwrap());
    // Deleting through a prefix deletes that prefix's keys only.
    b.set("y", b"b's").unwrap();
    a.delete_many(&["x", "y"]).unwrap();
    assert!(!base.check(&["a/x"]).unwrap() && !base.check(&["a/y"]).unwrap());
    assert_eq!(b.multi_get(&["x", "y"]).unwrap(), vec![b"from b".to_vec(), b"b's".to_vec()]);
    assert_eq!(a.get("z").unwrap(), b"2");
}

#[test]
fn keys_carry_torchs_slash_prefix_on_the_wire() {
    let s = server();
    let store = client(&s);
    store.set("x", b"1").unwrap();
    // SET has no reply; a round trip on the same connection orders it before what follows.
    assert!(store.check(&["x"]).unwrap());
    // A raw client sees the wire key "/x", as a PyTorch client would send it.
    let mut raw = raw_client(&s);
    send(&mut raw, &Request::Get { key: b"/x".to_vec() });
    let mut reply = [0u8; 9];
    raw.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[..8], &1u64.to_le_bytes());
    assert_eq!(reply[8], b'1');
    assert_eq!(store.list_keys().unwrap(), vec!["x".to_string()]);
}

#[test]
fn a_timed_out_wait_leaves_no_stray_byte() {
    let s = server();
    let waiter = client(&s);
    let setter = client(&s);
    for round in 0..20 {
        let key = format!("late{round}");
        assert!(waiter.wait_timeout(&[&key], Duration::from_millis(5)).unwrap_err().is_timeout());
        setter.set(&key, b"now").unwrap();
        // If a stray STOP_WAITING byte were left, this reply would be misread.
        assert_eq!(waiter.add("counter", 1).unwrap(), round + 1);
    }
}

#[test]
fn one_set_wakes_every_concurrent_waiter() {
    let s = server();
    let addr = s.local_addr().to_string();
    let n = 64;
    let ready = Arc::new(std::sync::Barrier::new(n + 1));
    let waiters: Vec<_> = (0..n)
        .map(|_| {
            let (addr, ready) = (addr.clone(), ready.clone());
            std::thread::spawn(move || {
                let c = TcpStore::connect(&addr, quick()).unwrap();
                ready.wait();
                c.get_timeout("go", Duration::from_secs(20)).unwrap()
            })
        })
        .collect();
    ready.wait();
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    client(&s).set("go", b"now").unwrap();
    for w in waiters {
        assert_eq!(w.join().unwrap(), b"now");
    }
    assert!(t.elapsed() < Duration::from_secs(10), "waking took {:?}", t.elapsed());
}

#[test]
fn a_thousand_simultaneous_clients() {
    let s = server();
    let addr = s.local_addr().to_string();
    let n = 1000;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let values = rt.block_on(async {
        let mut clients = Vec::new();
        for _ in 0..n {
            clients.push(AsyncStoreClient::connect(&addr, &quick()).await.unwrap());
        }
        let tasks: Vec<_> = clients
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                tokio::spawn(async move {
                    c.set(&format!("c/{i}"), i.to_string().as_bytes()).await.unwrap();
                    // Every client reads a neighbour's key, waiting for it if need be.
                    let v = c.get(&format!("c/{}", (i + 1) % n), Duration::from_secs(30)).await.unwrap();
                    (c, v)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        assert_eq!(s.connections(), n, "all {n} connections open at once");
        out.into_iter().map(|(_, v)| v).collect::<Vec<_>>()
    });
    for (i, v) in values.iter().enumerate() {
        assert_eq!(v, &((i + 1) % n).to_string().into_bytes());
    }
}

/// A store with a secret that trusts nobody without it, not even this user on this host (the
/// clients here are all this process's).
fn secret_server(secret: &str) -> StoreServer {
    let options = ServerOptions { secret: Secret::new(secret), trust_local_user: false, ..Default::default() };
    StoreServer::start("127.0.0.1:0", options).unwrap()
}

#[test]
fn this_user_on_this_host_needs_no_secret() {
    // The default: processes of the store's user on its host are known by their sockets'
    // credentials (PyTorch's clients, which cannot authenticate, work under `symmem run`).
    let s =
        StoreServer::start("127.0.0.1:0", ServerOptions { secret: Secret::new("k"), ..Default::default() }).unwrap();
    let addr = s.local_addr().to_string();
    let plain = TcpStore::connect(&addr, quick()).unwrap();
    plain.set("a", b"1").unwrap();
    // A client holding the secret authenticates anyway, and a wrong secret is still refused.
    let holder = TcpStore::connect(&addr, ClientOptions { secret: Secret::new("k"), ..quick() }).unwrap();
    assert_eq!(holder.get("a").unwrap(), b"1");
    let wrong = TcpStore::connect(&addr, ClientOptions { secret: Secret::new("not k"), ..quick() });
    assert!(matches!(wrong, Err(Error::Auth { .. })), "{wrong:?}");
}

#[test]
fn authentication_admits_only_the_secret_holder() {
    let s = secret_server("correct horse");
    let addr = s.local_addr().to_string();
    let good = TcpStore::connect(&addr, ClientOptions { secret: Secret::new("correct horse"), ..quick() }).unwrap();
    good.set("k", b"v").unwrap();
    assert_eq!(good.get("k").unwrap(), b"v");

    let wrong = TcpStore::connect(&addr, ClientOptions { secret: Secret::new("battery staple"), ..quick() });
    assert!(matches!(wrong, Err(Error::Auth { .. })), "{wrong:?}");
    let none = TcpStore::connect(&addr, quick());
    let msg = none.unwrap_err().to_string();
    assert!(msg.contains("SYMMEM_STORE_SECRET"), "{msg}");

    // A raw client that skips authentication can neither write nor read.
    let mut raw = raw_client(&s);
    send(&mut raw, &Request::Set { key: b"/k".to_vec(), value: b"evil".to_vec() });
    send(&mut raw, &Request::Get { key: b"/k".to_vec() });
    assert_closed(&mut raw);
    assert_eq!(good.get("k").unwrap(), b"v");

    // A client with a secret refuses a server without one.
    let open = server();
    let r = TcpStore::connect(&open.local_addr().to_string(), ClientOptions { secret: Secret::new("x"), ..quick() });
    assert!(matches!(r, Err(Error::Auth { .. })), "{r:?}");
}

/// A relay between a client and `server` on loopback that records what the client sends
/// and, with `flip_at`, flips a bit of the byte at that offset of the client's stream; its
/// address and the record.
fn relay(server: std::net::SocketAddr, flip_at: Option<usize>) -> (String, Arc<std::sync::Mutex<Vec<u8>>>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut s = TcpStream::connect(server).unwrap();
        let (mut c2, mut s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
        std::thread::spawn(move || {
            let mut b = [0u8; 65536];
            while let Ok(n @ 1..) = s2.read(&mut b) {
                if c2.write_all(&b[..n]).is_err() {
                    break;
                }
            }
            let _ = c2.shutdown(std::net::Shutdown::Both);
        });
        let mut b = [0u8; 65536];
        while let Ok(n @ 1..) = c.read(&mut b) {
            let mut r = record.lock().unwrap();
            if let Some(at) = flip_at.filter(|&at| r.len() <= at && at < r.len() + n) {
                b[at - r.len()] ^= 0x10;
            }
            r.extend_from_slice(&b[..n]);
            drop(r);
            if s.write_all(&b[..n]).is_err() {
                break;
            }
        }
        let _ = s.shutdown(std::net::Shutdown::Both);
    });
    (addr, seen)
}

// Issue 51, item 1: after a store's handshake, the rest of an authenticated connection was
// plain TCPStore protocol: whoever carried its bytes could read the values and change them (a
// flipped bit in a SET was stored). Now it is a sealed stream under keys of the connection.
#[test]
fn an_authenticated_store_connection_is_sealed_after_its_handshake() {
    let s = secret_server("correct horse");
    let opts = || ClientOptions { secret: Secret::new("correct horse"), ..quick() };
    // Every operation works over the sealed stream, values larger than a record included.
    let c = TcpStore::connect(&s.local_addr().to_string(), opts()).unwrap();
    every_operation(&c);
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    c.set("big", &big).unwrap();
    assert_eq!(c.get("big").unwrap(), big);
    assert_eq!(c.multi_get(&["big", "big"]).unwrap(), vec![big.clone(), big.clone()]);

    // What a relay sees of a value is not the value.
    let (via, seen) = relay(s.local_addr(), None);
    let c = TcpStore::connect(&via, opts()).unwrap();
    let value = b"a value only the job may read: 0123456789abcdef".repeat(10);
    c.set("private", &value).unwrap();
    assert_eq!(c.get("private").unwrap(), value);
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() > value.len(), "the relay carried {} bytes", seen.len());
    assert!(!seen.windows(32).any(|w| w == &value[..32]), "the value crossed the relay in the clear");

    // A bit flipped by a relay in the middle of a SET: the store closes the connection, the
    // client is told, and nothing is stored.
    let (via, _) = relay(s.local_addr(), Some(60_000));
    let c = TcpStore::connect(&via, opts()).unwrap();
    // (A SET is not answered: the client learns of the close at its next request.)
    let _ = c.set("flipped", &big);
    let next = c.check(&["flipped"]);
    assert!(next.is_err(), "the connection outlived a SET whose bytes were changed on the way: {next:?}");
    let check = TcpStore::connect(&s.local_addr().to_string(), opts()).unwrap();
    assert!(!check.check(&["flipped"]).unwrap(), "a changed SET was stored");
}

fn raw_client(s: &StoreServer) -> TcpStream {
    let mut c = TcpStream::connect(s.local_addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(&[0x00]).unwrap();
    c.write_all(&VALIDATION_MAGIC.to_le_bytes()).unwrap();
    c
}

fn send(c: &mut TcpStream, r: &Request) {
    let mut b = Vec::new();
    r.encode(&mut b);
    // The peer may already have closed; the test then checks for the close.
    let _ = c.write_all(&b);
}

fn assert_closed(c: &mut TcpStream) {
    let mut buf = [0u8; 64];
    match c.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the server to close the connection, got {other:?}"),
    }
}

#[test]
fn malformed_input_closes_only_that_connection() {
    let s = server();
    let healthy = client(&s);
    healthy.set("alive", b"yes").unwrap();

    let mut unknown = raw_client(&s);
    unknown.write_all(&[0x63]).unwrap();
    assert_closed(&mut unknown);

    let mut bad_magic = TcpStream::connect(s.local_addr()).unwrap();
    bad_magic.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    bad_magic.write_all(&[0x00, 1, 2, 3, 4]).unwrap();
    assert_closed(&mut bad_magic);

    let mut no_handshake = TcpStream::connect(s.local_addr()).unwrap();
    no_handshake.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    send(&mut no_handshake, &Request::GetNumKeys);
    assert_closed(&mut no_handshake);

    // A length header past the limit is refused before any of the bytes arrive.
    let mut oversized = raw_client(&s);
    let mut b = vec![0x01];
    b.extend_from_slice(&(1u64 << 40).to_le_bytes());
    oversized.write_all(&b).unwrap();
    assert_closed(&mut oversized);

    let mut twice = raw_client(&s);
    twice.write_all(&[0x00]).unwrap();
    twice.write_all(&VALIDATION_MAGIC.to_le_bytes()).unwrap();
    assert_closed(&mut twice);

    assert_eq!(healthy.get("alive").unwrap(), b"yes");
    assert!(healthy.ping().is_ok());
}

#[test]
fn split_and_pipelined_requests_are_served() {
    let s = server();
    let mut c = raw_client(&s);
    // One request, one byte per segment.
    let mut b = Vec::new();
    Request::Add { key: b"/n".to_vec(), delta: 5 }.encode(&mut b);
    for byte in &b {
        c.write_all(&[*byte]).unwrap();
        c.flush().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut r = [0u8; 8];
    c.read_exact(&mut r).unwrap();
    assert_eq!(i64::from_le_bytes(r), 5);
    // Three requests in one segment.
    let mut b = Vec::new();
    for d in [1, 2, 3] {
        Request::Add { key: b"/n".to_vec(), delta: d }.encode(&mut b);
    }
    c.write_all(&b).unwrap();
    let mut r = [0u8; 24];
    c.read_exact(&mut r).unwrap();
    let got: Vec<i64> = r.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(got, vec![6, 8, 11]);
}

#[test]
fn a_client_dying_mid_wait_is_forgotten() {
    let s = server();
    {
        let mut c = raw_client(&s);
        send(&mut c, &Request::Wait { keys: vec![b"/k".to_vec()] });
        std::thread::sleep(Duration::from_millis(50));
    } // dropped: the connection closes while it waits
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.connections() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(s.connections(), 0);
    let store = client(&s);
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
}

#[test]
fn add_on_text_reports_the_close_and_the_client_recovers() {
    let s = server();
    let store = client(&s);
    store.set("text", b"hello").unwrap();
    let err = store.add("text", 1).unwrap_err();
    assert!(matches!(err, Error::ConnectionClosed { .. }), "{err}");
    // The next call reconnects.
    assert_eq!(store.add("fine", 1).unwrap(), 1);
}

#[test]
fn oversized_requests_are_refused_before_sending() {
    let s = server();
    let store = client(&s);
    let err = store.set(&"k".repeat(9000), b"v").unwrap_err();
    assert!(matches!(err, Error::TooLarge(_)), "{err}");
    assert!(err.to_string().contains("8192"), "{err}");
    let big = vec![0u8; 8 * 1024 * 1024 + 1];
    assert!(matches!(store.set("k", &big).unwrap_err(), Error::TooLarge(_)));
    // Exactly 8 MiB is allowed, as by torch's server.
    let max = vec![7u8; 8 * 1024 * 1024];
    store.set("big", &max).unwrap();
    assert_eq!(store.get("big").unwrap(), max);
}

#[test]
fn connecting_retries_until_the_server_is_up_then_times_out() {
    // Find a free port, then start the server on it only after the client began connecting.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let a = addr.clone();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        StoreServer::start(&a, ServerOptions::default()).unwrap()
    });
    let store = TcpStore::connect(&addr, quick()).unwrap();
    let _server = late.join().unwrap();
    store.set("up", b"1").unwrap();

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let t = Instant::now();
    let err = TcpStore::connect(
        &format!("127.0.0.1:{port}"),
        ClientOptions { timeout: Duration::from_millis(300), secret: None },
    )
    .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(err.to_string().contains(&port.to_string()), "{err}");
}
