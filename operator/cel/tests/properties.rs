//! Property tests of the parser, checker and evaluator on arbitrary input up to the
//! expression length limit: they never panic, never overflow the stack, and finish in
//! bounded time (the checker refuses deep nesting and expensive expressions, the
//! runtime meter stops the rest).

use std::time::{Duration, Instant};

use muster_cel::name_map::NameMap;
use muster_cel::quantity::Quantity;
use muster_cel::{AttributeValue, Attributes, DeviceView, MAX_EXPRESSION_LENGTH};
use proptest::prelude::*;

/// Generous: a debug build on a busy machine. What matters is that nothing runs away.
const TIME_BOUND: Duration = Duration::from_secs(5);

fn with_device<R>(f: impl FnOnce(&DeviceView<'_>) -> R) -> R {
    let attributes = Attributes::from([
        ("model".into(), AttributeValue::String("H100".into())),
        ("cores".into(), AttributeValue::Int(128)),
        ("version".into(), AttributeValue::Version("1.2.3".into())),
        ("k8s.io/rack".into(), AttributeValue::String("r1".into())),
    ]);
    let capacity = NameMap::from([("memory".to_string(), Quantity::parse("80Gi").expect("quantity"))]);
    f(&DeviceView {
        driver: "gpu.example.com",
        attributes: &attributes,
        capacity: &capacity,
        allow_multiple_allocations: true,
    })
}

/// Compiles and, when that succeeds, evaluates, on a worker thread watched by a timer;
/// fails if that takes too long, or if the compiler panicked (compilation runs on its
/// own thread, which reports a panic as an internal error).
fn run(expression: &str) -> Result<(), TestCaseError> {
    let (done, outcome) = std::sync::mpsc::channel();
    let owned = expression.to_string();
    std::thread::spawn(move || {
        let internal = with_device(|device| match muster_cel::compile(&owned) {
            Ok(program) => {
                let _ = program.evaluate(device);
                None
            }
            Err(e) if e.message.contains("internal compiler error") => Some(e.message),
            Err(_) => None,
        });
        let _ = done.send(internal);
    });
    let shown = || expression.chars().take(200).collect::<String>();
    match outcome.recv_timeout(TIME_BOUND) {
        Ok(internal) => prop_assert!(internal.is_none(), "the compiler panicked on: {}", shown()),
        // A runaway worker is left behind; the test fails.
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            prop_assert!(
                false,
                "no result within {TIME_BOUND:?} on {} bytes: {}",
                expression.len(),
                shown()
            )
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            prop_assert!(false, "the evaluator panicked on: {}", shown())
        }
    }
    Ok(())
}

const VOCABULARY: &[&str] = &[
    "device",
    ".",
    "attributes",
    "capacity",
    "driver",
    "allowMultipleAllocations",
    "[",
    "]",
    "(",
    ")",
    "{",
    "}",
    ",",
    ":",
    "?",
    "\"gpu.example.com\"",
    "\"k8s.io\"",
    "model",
    "cores",
    "version",
    "memory",
    "1",
    "0",
    "-1",
    "2u",
    "1.5",
    "9223372036854775807",
    "true",
    "false",
    "null",
    "+",
    "-",
    "*",
    "/",
    "%",
    "==",
    "!=",
    "<",
    ">=",
    "&&",
    "||",
    "!",
    "in",
    "x",
    "y",
    "all",
    "exists",
    "exists_one",
    "map",
    "filter",
    "has",
    "size",
    "optional",
    "of",
    "none",
    "orValue",
    "value",
    "lists",
    "range",
    "quantity",
    "semver",
    "\"1Gi\"",
    "\"1.2.3\"",
    "matches",
    "\"a+\"",
    "\"(\"",
    "cel",
    "bind",
    "transformList",
    "transformMap",
    "transformMapEntry",
    "sortBy",
    "i",
    "v",
    ".?",
    "[?",
    "flatten",
    "sort",
    "join",
    "split",
    "\",\"",
    "\"\"",
    "sets",
    "contains",
    "dyn",
    "int",
    "string",
    "type",
    "format",
    "timestamp",
    "b\"\\xff\"",
    "r\"\\d\"",
    "'''",
    "//",
    "\n",
    "1e308",
    "0x7f",
];

/// Openers that nest; each comes with its closer. The short ones first: they reach
/// thousands of levels within the length limit.
const NESTERS: &[(&str, &str)] = &[
    ("(", ")"),
    ("[", "]"),
    ("[", "][0]"),
    ("!", ""),
    ("{1: ", "}"),
    ("!", ""),
    ("-", ""),
    ("size(", ")"),
    ("[1].all(x, ", ")"),
    ("cel.bind(v, 1, ", ")"),
    ("optional.of(", ").value()"),
    ("dyn(", ")"),
    ("true ? ", " : false"),
    ("[", "][0]"),
];

/// Nests `core` as deep as the choices go within the length limit; `short` picks
/// among the first nesters only.
fn nested(choices: &[usize], short: bool, core: &str) -> String {
    let pool = if short { 3 } else { NESTERS.len() };
    let mut open = String::new();
    let mut close = String::new();
    for &c in choices {
        let (o, cl) = NESTERS[c % pool];
        if open.len() + close.len() + o.len() + cl.len() + core.len() > MAX_EXPRESSION_LENGTH {
            break;
        }
        open.push_str(o);
        close.insert_str(0, cl);
    }
    format!("{open}{core}{close}")
}

/// Pieces of `string.format` format strings: clauses, broken clauses, text.
const FORMAT_PIECES: &[&str] = &[
    "%s",
    "%d",
    "%f",
    "%e",
    "%b",
    "%o",
    "%x",
    "%X",
    "%%",
    "%",
    ".",
    "%.",
    "%.2f",
    "%.65535e",
    "%.99999f",
    "%.30000f",
    "%.10000009e",
    "%.99999999999999999999f",
    "%\u{e9}",
    "%.3",
    "a",
    " ",
    "\u{e9}",
    "9",
];

/// Arguments of every type, some no clause accepts.
const FORMAT_ARGS: &[&str] = &[
    "1",
    "-1",
    "1u",
    "1.5",
    "-0.0",
    "1e308",
    "double(\"NaN\")",
    "\"NaN\"",
    "\"Infinity\"",
    "\"x\"",
    "b\"\\xff\"",
    "true",
    "null",
    "[1, \"a\"]",
    "{\"k\": [1.5]}",
    "int",
    "timestamp(0)",
    "duration(\"1s\")",
    "optional.none()",
    "dyn(optional.none())",
    "9223372036854775807",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn string_format(
        pieces in proptest::collection::vec(0..FORMAT_PIECES.len(), 0..40),
        args in proptest::collection::vec(0..FORMAT_ARGS.len(), 0..6),
    ) {
        let format: String = pieces.iter().map(|&i| FORMAT_PIECES[i]).collect();
        let list = args.iter().map(|&i| FORMAT_ARGS[i]).collect::<Vec<_>>().join(", ");
        // A literal call is checked when compiling, a dynamic one only when it runs.
        run(&format!("\"{format}\".format([{list}]) != \"\""))?;
        run(&format!("dyn(\"{format}\").format(dyn([{list}])) != \"\""))?;
    }

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..MAX_EXPRESSION_LENGTH + 64)) {
        run(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn arbitrary_text(text in "\\PC{0,2000}") {
        run(&text)?;
    }

    #[test]
    fn token_soup(indexes in proptest::collection::vec(0..VOCABULARY.len(), 0..2500), glue in 0..3usize) {
        let tokens: Vec<&str> = indexes.iter().map(|&i| VOCABULARY[i]).collect();
        let text = tokens.join(["", " ", "\n"][glue]);
        run(&text)?;
    }

    #[test]
    fn deep_nesting(
        choices in proptest::collection::vec(any::<usize>(), 0..5000),
        short in any::<bool>(),
        core in 0..3usize,
    ) {
        run(&nested(&choices, short, ["true", "1", "device.attributes[\"gpu.example.com\"].cores"][core]))?;
        // Unbalanced: only the openers.
        let mut open = String::new();
        for &c in &choices {
            open.push_str(NESTERS[c % NESTERS.len()].0);
        }
        run(&open)?;
    }

    #[test]
    fn long_chains(
        terms in proptest::collection::vec((0..6usize, 0..8usize), 1..5200),
        uniform in any::<bool>(),
    ) {
        // Without spaces, up to about five thousand terms fit in the length limit; a
        // chain of one operator often type-checks, and then evaluates.
        const OPS: &[&str] = &["+", "*", "&&", "||", "==", "-", ".", "?1:"];
        const TERMS: &[&str] = &["1", "x", "true", "\"a\"", "device.driver", "[1]"];
        let mut text = String::new();
        for (i, (t, op)) in terms.iter().enumerate() {
            if i > 0 {
                text.push_str(OPS[if uniform { terms[0].1 } else { *op }]);
            }
            text.push_str(TERMS[if uniform { terms[0].0 } else { *t }]);
            if text.len() > MAX_EXPRESSION_LENGTH {
                break;
            }
        }
        text.truncate(MAX_EXPRESSION_LENGTH);
        run(&text)?;
    }

    #[test]
    fn big_comprehensions(
        sizes in proptest::collection::vec(0..400_000i64, 1..4),
        kind in 0..6usize,
    ) {
        // Nested comprehensions over computed ranges: either the estimate refuses them
        // or the runtime meter bounds them.
        let mut body = String::from("true");
        for (depth, n) in sizes.iter().enumerate() {
            let var = format!("v{depth}");
            body = match kind {
                0 => format!("lists.range({n}).all({var}, {body})"),
                1 => format!("lists.range({n}).exists({var}, !({body}))"),
                2 => format!("lists.range({n}).map({var}, {body}).size() >= 0"),
                3 => format!("lists.range({n}).filter({var}, {body}).size() >= 0"),
                4 => format!("lists.range({n}).transformMap(i, {var}, {body}).size() >= 0"),
                _ => format!("dyn(lists.range({n})).sortBy({var}, -{var}).size() >= 0 && {body}"),
            };
        }
        run(&body)?;
    }
}

/// The runtime meter bounds what the estimate lets through when the limit is low.
#[test]
fn runtime_meter_bounds_evaluation() {
    with_device(|device| {
        let program = muster_cel::compile("lists.range(300).all(i, lists.range(300).all(j, i + j >= 0))").unwrap();
        let started = Instant::now();
        assert!(program.evaluate_with_limit(device, 1000).is_err());
        assert!(started.elapsed() < TIME_BOUND);
    });
}
