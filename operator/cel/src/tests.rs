//! Evaluation tests: table-driven expressions against one fixture device.

use super::*;
use crate::name_map::NameMap;
use crate::quantity::Quantity;

struct Fixture {
    attributes: Attributes,
    capacity: NameMap<Quantity>,
}

impl Fixture {
    fn new() -> Self {
        let attributes = Attributes::from([
            ("model".into(), AttributeValue::String("H100".into())),
            ("cores".into(), AttributeValue::Int(128)),
            ("ecc".into(), AttributeValue::Bool(true)),
            ("driverVersion".into(), AttributeValue::Version("1.2.3".into())),
            ("badVersion".into(), AttributeValue::Version("1.2".into())),
            ("gpu.example.com/qualified".into(), AttributeValue::Int(7)),
            ("k8s.io/pcieRoot".into(), AttributeValue::String("pci0000:00".into())),
            ("other.example.com/flag".into(), AttributeValue::Bool(false)),
        ]);
        let capacity = NameMap::from([
            ("memory".into(), Quantity::parse("80Gi").unwrap()),
            ("k8s.io/slots".into(), Quantity::parse("4").unwrap()),
        ]);
        Fixture { attributes, capacity }
    }

    fn view(&self) -> DeviceView<'_> {
        DeviceView {
            driver: "gpu.example.com",
            attributes: &self.attributes,
            capacity: &self.capacity,
            allow_multiple_allocations: true,
        }
    }
}

/// "true", "false", "err:<substring>" (evaluation error) or "compile:<substring>".
fn outcome(expression: &str, device: &DeviceView<'_>) -> String {
    match compile(expression) {
        Err(e) => format!("compile:{}", e.message),
        Ok(program) => match program.evaluate(device) {
            Ok(b) => b.to_string(),
            Err(e) => format!("err:{}", e.message),
        },
    }
}

fn check_cases(cases: &[(&str, &str)]) {
    let fixture = Fixture::new();
    let device = fixture.view();
    let mut failures = Vec::new();
    for (expression, expected) in cases {
        let got = outcome(expression, &device);
        let ok = match expected.split_once(':') {
            Some((kind, needle)) => got.starts_with(kind) && got.contains(needle),
            None => got == *expected,
        };
        if !ok {
            failures.push(format!("{expression}\n    expected {expected}\n    got      {got}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn device_attributes_and_capacity() {
    check_cases(&[
        (r#"device.driver == "gpu.example.com""#, "true"),
        (r#".device.driver == "gpu.example.com""#, "true"),
        (r#"device.attributes["gpu.example.com"].model == "H100""#, "true"),
        (r#"device.attributes["gpu.example.com"]["model"] == "H100""#, "true"),
        (r#"device.attributes["gpu.example.com"].cores > 100"#, "true"),
        (r#"device.attributes["gpu.example.com"].ecc"#, "true"),
        (r#"device.attributes["gpu.example.com"].qualified == 7"#, "true"),
        (r#"device.attributes["k8s.io"].pcieRoot == "pci0000:00""#, "true"),
        (r#"device.attributes["other.example.com"].flag"#, "false"),
        (r#"device.attributes[device.driver].model == "H100""#, "true"),
        (
            r#"device.attributes["gpu.example.com"].missing == 1"#,
            "err:no such key: missing",
        ),
        (
            r#"device.attributes["gpu.example.com"]["missing"] == 1"#,
            "err:no such key: missing",
        ),
        (
            r#"device.attributes["gpu.example.com"]["k8s.io/pcieRoot"] == 1"#,
            "err:no such key",
        ),
        (r#"device.attributes["unknown.domain"].x == 1"#, "err:no such key: x"),
        (r#"size(device.attributes["unknown.domain"]) == 0"#, "true"),
        (r#"device.attributes["unknown.domain"].size() == 0"#, "true"),
        (r#"device.attributes["unknown.domain"] == {}"#, "true"),
        (r#"has(device.attributes["gpu.example.com"].model)"#, "true"),
        (r#"has(device.attributes["gpu.example.com"].nope)"#, "false"),
        (r#"has(device.attributes["gpu.example.com"].pcieRoot)"#, "false"),
        (r#"has(device.attributes["k8s.io"].pcieRoot)"#, "true"),
        (r#"has(device.attributes["nope"].x)"#, "false"),
        (r#"has(device.attributes["gpu.example.com"].badVersion)"#, "true"),
        (r#"device.attributes["gpu.example.com"].?nope.orValue(1) == 1"#, "true"),
        (
            r#"device.attributes["gpu.example.com"].?cores.orValue(1) == 128"#,
            "true",
        ),
        (r#"device.attributes["gpu.example.com"].?model.hasValue()"#, "true"),
        (r#"device.attributes["nope"].?x.hasValue()"#, "false"),
        (
            r#"device.attributes["gpu.example.com"][?"cores"].value() == 128"#,
            "true",
        ),
        (r#""model" in device.attributes["gpu.example.com"]"#, "true"),
        (r#""pcieRoot" in device.attributes["gpu.example.com"]"#, "false"),
        (
            r#"1 in device.attributes["gpu.example.com"]"#,
            "compile:found no matching overload for '@in'",
        ),
        (r#""k8s.io" in device.attributes"#, "true"),
        (r#""nope" in device.attributes"#, "false"),
        (r#"size(device.attributes["gpu.example.com"]) == 6"#, "true"),
        (r#"size(device.attributes) == 3"#, "true"),
        (
            r#"device.attributes["gpu.example.com"].exists(k, k == "model")"#,
            "true",
        ),
        (
            r#"device.attributes["gpu.example.com"].all(k, k != "pcieRoot")"#,
            "true",
        ),
        (
            r#"device.attributes["gpu.example.com"].filter(k, k.startsWith("c")) == ["cores"]"#,
            "true",
        ),
        (r#"device.attributes.exists(d, d == "k8s.io")"#, "true"),
        (r#"device.attributes.all(d, size(device.attributes[d]) > 0)"#, "true"),
        (
            r#"device.attributes["gpu.example.com"].exists(k, v, k == "cores" && v == 128)"#,
            "true",
        ),
        (
            r#"device.attributes["gpu.example.com"].all(k, v, k != "")"#,
            "err:parse semantic version",
        ),
        (
            r#"device.attributes["k8s.io"].transformList(k, v, v) == ["pci0000:00"]"#,
            "true",
        ),
        (r#"device.attributes["k8s.io"] == {"pcieRoot": "pci0000:00"}"#, "true"),
        (
            r#"device.attributes["gpu.example.com"].driverVersion == semver("1.2.3")"#,
            "true",
        ),
        (
            r#"device.attributes["gpu.example.com"].driverVersion.isGreaterThan(semver("1.2.0"))"#,
            "true",
        ),
        (
            r#"device.attributes["gpu.example.com"].driverVersion.major() == 1"#,
            "true",
        ),
        (
            r#"device.attributes["gpu.example.com"].badVersion == semver("1.2.0")"#,
            "err:parse semantic version",
        ),
        (
            r#"device.attributes["gpu.example.com"].model == "H100" || device.attributes["gpu.example.com"].badVersion.major() == 1"#,
            "true",
        ),
        (
            r#"device.capacity["gpu.example.com"].memory == quantity("80Gi")"#,
            "true",
        ),
        (
            r#"device.capacity["gpu.example.com"].memory.compareTo(quantity("80Gi")) == 0"#,
            "true",
        ),
        (
            r#"device.capacity["gpu.example.com"].memory.isGreaterThan(quantity("40Gi"))"#,
            "true",
        ),
        (r#"device.capacity["k8s.io"].slots.asInteger() == 4"#, "true"),
        (
            r#"device.capacity["gpu.example.com"].nope.sign() == 1"#,
            "compile:found no matching overload for 'sign'",
        ),
        (r#"has(device.capacity["gpu.example.com"].memory)"#, "true"),
        (r#"device.allowMultipleAllocations"#, "true"),
        (r#"has(device.driver)"#, "true"),
        (r#"device.nope == 1"#, "compile:undefined field 'nope'"),
        (r#"has(device.nope)"#, "compile:undefined field 'nope'"),
        (r#"device.driver.size() > 0"#, "true"),
        (
            r#"cel.bind(gpu, device.attributes["gpu.example.com"], gpu.model == "H100" && gpu.ecc)"#,
            "true",
        ),
        (r#"cel.bind(d, device, d.driver == "gpu.example.com")"#, "true"),
        (r#"cel.bind(d, device, d.nope == 1)"#, "compile:undefined field 'nope'"),
        (r#"cel.bind(x, 1 / 0, true)"#, "true"),
        (r#"cel.bind(x, 1 / 0, x == 1)"#, "err:division by zero"),
        (r#"type(device) == type(device)"#, "compile:too complex"),
        (r#"type(device.attributes["x"]) == map"#, "compile:too complex"),
        (
            r#"device.attributes["gpu.example.com"].model"#,
            "err:expression must return a boolean, got string",
        ),
    ]);
}

#[test]
fn arithmetic_and_comparison() {
    check_cases(&[
        ("1 + 2 == 3", "true"),
        ("7 / 2 == 3", "true"),
        ("-7 / 2 == -3", "true"),
        ("-7 % 3 == -1", "true"),
        ("7 % -3 == 1", "true"),
        ("2 * 3 % 4 == 2", "true"),
        ("3 - 2 - 1 == 0", "true"),
        ("1 + 2 * 3 == 7", "true"),
        ("(1 + 2) * 3 == 9", "true"),
        ("9223372036854775807 + 1 == 0", "err:integer overflow"),
        ("-9223372036854775808 - 1 == 0", "err:integer overflow"),
        ("-9223372036854775808 / -1 == 0", "err:integer overflow"),
        ("-9223372036854775808 % -1 == 0", "err:integer overflow"),
        ("9223372036854775807 * 2 == 0", "err:integer overflow"),
        ("-(-9223372036854775807 - 1) == 0", "err:integer overflow"),
        ("-9223372036854775808 < 0", "true"),
        ("1 / 0 == 0", "err:division by zero"),
        ("1 % 0 == 0", "err:modulus by zero"),
        ("1u / 0u == 0u", "err:division by zero"),
        ("1u + 2u == 3u", "true"),
        ("0u - 1u == 0u", "err:unsigned integer overflow"),
        ("18446744073709551615u + 1u == 0u", "err:unsigned integer overflow"),
        ("1.0 / 0.0 > 1e308", "true"),
        ("0.5 + 0.25 == 0.75", "true"),
        ("5.0 % 2.0 == 1.0", "compile:found no matching overload for '_%_'"),
        ("1 + 1.0 == 2.0", "compile:found no matching overload for '_+_'"),
        ("1 + 1u == 2", "compile:found no matching overload for '_+_'"),
        ("1 + \"a\" == 2", "compile:found no matching overload for '_+_'"),
        ("1 == 1.0", "compile:found no matching overload for '_==_'"),
        ("1 == 1u", "compile:found no matching overload for '_==_'"),
        ("1u == 1.0", "compile:found no matching overload for '_==_'"),
        ("1.0 != 1", "compile:found no matching overload for '_!=_'"),
        ("1 < 1.5", "true"),
        ("2u > 1", "true"),
        ("-1 < 0u", "true"),
        ("18446744073709551615u > 9223372036854775807", "true"),
        ("9223372036854775807 < 9223372036854775808.0", "false"),
        ("1.5 >= 1", "true"),
        ("1 <= 1u", "true"),
        ("double(\"NaN\") < 1.0", "err:NaN values cannot be ordered"),
        ("double(\"NaN\") == double(\"NaN\")", "false"),
        ("\"abc\" < \"abd\"", "true"),
        ("\"a\" < \"B\"", "false"),
        ("\"é\" > \"z\"", "true"),
        ("true > false", "true"),
        ("b\"a\" < b\"b\"", "true"),
        ("\"a\" < 1", "compile:found no matching overload for '_<_'"),
        ("[1] < [2]", "compile:found no matching overload for '_<_'"),
        ("\"ab\" + \"cd\" == \"abcd\"", "true"),
        ("[1] + [2] == [1, 2]", "true"),
        ("[] + [1] == [1]", "true"),
        ("b\"a\" + b\"b\" == b\"ab\"", "true"),
        (
            "{\"a\": 1} + {\"b\": 2} == {}",
            "compile:found no matching overload for '_+_'",
        ),
        ("1 < 2 == true", "true"),
        ("-(1) == -1", "true"),
        ("--1 == 1", "true"),
        ("-\"a\" == 1", "compile:found no matching overload for '-_'"),
        ("0x10 == 16", "true"),
        ("0xFFu == 255u", "true"),
        ("1e3 == 1000.0", "true"),
        (".5 == 0.5", "true"),
        ("1.5e-3 == 0.0015", "true"),
        ("18446744073709551615u == 18446744073709551615u", "true"),
        ("9223372036854775808 == 1", "compile:invalid int literal"),
        ("(true ? 1 : 2) == 1", "true"),
        ("(false ? 1 : 2) == 2", "true"),
        ("true ? true : 1 / 0 == 0", "true"),
        ("(1 ? true : false)", "compile:found no matching overload for '_?_:_'"),
        ("1 + 1", "compile:must evaluate to bool or the unknown type, not int"),
        ("\"a\"", "compile:must evaluate to bool or the unknown type, not string"),
        (
            "null",
            "compile:must evaluate to bool or the unknown type, not null_type",
        ),
        ("1.5", "compile:must evaluate to bool or the unknown type, not double"),
        (
            "[true]",
            "compile:must evaluate to bool or the unknown type, not list(bool)",
        ),
    ]);
}

#[test]
fn logic_and_error_absorption() {
    check_cases(&[
        ("true && true", "true"),
        ("true && false", "false"),
        ("false || true", "true"),
        ("!true == false", "true"),
        ("!!true", "true"),
        ("!(1 == 1)", "false"),
        ("!1", "compile:found no matching overload for '!_'"),
        ("true || false && false", "true"),
        ("!false && false", "false"),
        ("false && (1 / 0 == 0)", "false"),
        ("(1 / 0 == 0) && false", "false"),
        ("true || (1 / 0 == 0)", "true"),
        ("(1 / 0 == 0) || true", "true"),
        ("true && (1 / 0 == 0)", "err:division by zero"),
        ("(1 / 0 == 0) || false", "err:division by zero"),
        ("(1 / 0 == 0) && (1 % 0 == 0)", "err:division by zero"),
        ("(1 % 0 == 0) || (1 / 0 == 0)", "err:modulus by zero"),
        ("false && 1 == 1 / 0", "false"),
        ("1 && false", "compile:expected type 'bool' but found 'int'"),
        ("1 || true", "compile:expected type 'bool' but found 'int'"),
        ("1 && true", "compile:expected type 'bool' but found 'int'"),
        ("true && 1", "compile:expected type 'bool' but found 'int'"),
        (r#"device.attributes["gpu.example.com"].missing == 1 || true"#, "true"),
        (r#"device.attributes["gpu.example.com"].missing == 1 && false"#, "false"),
        ("[1, 0].exists(x, 1 / x == 1)", "true"),
        ("[0, 1].exists(x, 1 / x == 1)", "true"),
        ("[0, 2].exists(x, 1 / x == 1)", "err:division by zero"),
        ("[0, 1].all(x, 1 / x == 1)", "err:division by zero"),
        ("[0, 2].all(x, 1 / x == 1)", "false"),
        ("[0, 1].exists_one(x, 1 / x == 1)", "err:division by zero"),
        ("[1].all(x, 1)", "compile:expected type 'bool' but found 'int'"),
        ("[1, 2].exists(x, x == 2 || x / 0 == 1)", "true"),
    ]);
}

#[test]
fn equality_is_heterogeneous() {
    check_cases(&[
        ("1 == \"1\"", "compile:found no matching overload for '_==_'"),
        ("1 != \"1\"", "compile:found no matching overload for '_!=_'"),
        ("dyn(1) == \"1\"", "false"),
        ("null == null", "true"),
        ("null == 0", "compile:found no matching overload for '_==_'"),
        ("[1, 2] == [1, 2]", "true"),
        ("[1, 2] == [2, 1]", "false"),
        ("[1] == [1.0]", "compile:found no matching overload for '_==_'"),
        ("[1, dyn(\"a\")] == []", "compile:expected type 'int' but found 'dyn'"),
        ("[dyn(1), dyn(\"a\")] == [dyn(1), dyn(\"a\")]", "true"),
        (
            "[[1], [dyn(2)]] == []",
            "compile:expected type 'list(int)' but found 'list(dyn)'",
        ),
        ("[?optional.of(1), 2] == [1, 2]", "true"),
        (
            "{\"a\": 1} == {\"a\": 1.0}",
            "compile:found no matching overload for '_==_'",
        ),
        ("{\"a\": 1} == {\"b\": 1}", "false"),
        (
            "{1: \"a\"}[1u] == \"a\"",
            "compile:found no matching overload for '_[_]'",
        ),
        (
            "{1: \"a\"}[1.0] == \"a\"",
            "compile:found no matching overload for '_[_]'",
        ),
        ("{\"a\": 1, \"a\": 2}[\"a\"] == 2", "true"),
        ("{\"a\": 1}[\"b\"] == 1", "err:no such key: b"),
        ("{\"a\": 1}.a == 1", "true"),
        ("{\"a\": 1}.b == 1", "err:no such key: b"),
        ("[1, 2][1] == 2", "true"),
        ("[1, 2][1u] == 2", "compile:found no matching overload for '_[_]'"),
        ("[1, 2][2] == 2", "err:index '2' out of range in list size '2'"),
        ("[1, 2][-1] == 2", "err:out of range"),
        ("[1, 2][\"a\"] == 2", "compile:found no matching overload for '_[_]'"),
        ("\"abc\"[0] == \"a\"", "compile:found no matching overload for '_[_]'"),
        ("1.foo == 1", "compile:type 'int' does not support field selection"),
        ("optional.of(1) == optional.of(1)", "true"),
        ("optional.none() == optional.none()", "compile:too complex"),
        ("optional.of(1) == optional.none()", "false"),
        ("quantity(\"1\") == 1", "compile:found no matching overload for '_==_'"),
        ("[1, \"a\"] == []", "compile:expected type 'int' but found 'string'"),
        ("[1, 1u] == []", "compile:expected type 'int' but found 'uint'"),
        ("{\"a\": 1, \"b\": \"x\"} == {}", "compile:expected type"),
        ("{1.5: 1} == {}", "false"),
        ("{dyn(1.5): 1} == {}", "false"),
        ("2 in [1, 2, 3]", "true"),
        ("4 in [1, 2, 3]", "false"),
        ("2.0 in [1, 2]", "compile:found no matching overload for '@in'"),
        ("\"a\" in {\"a\": 1}", "true"),
        ("\"b\" in {\"a\": 1}", "false"),
        ("1 in \"abc\"", "compile:found no matching overload for '@in'"),
    ]);
}

#[test]
fn types() {
    check_cases(&[
        ("type(1) == int", "compile:too complex"),
        ("type(1u) == uint", "compile:too complex"),
        ("type(1.0) == double", "compile:too complex"),
        ("type(\"a\") == string", "compile:too complex"),
        ("type(b\"a\") == bytes", "compile:too complex"),
        ("type(true) == bool", "compile:too complex"),
        ("type(null) == null_type", "compile:too complex"),
        ("type([]) == list", "compile:too complex"),
        ("type({}) == map", "compile:too complex"),
        ("type(int) == type", "compile:too complex"),
        ("type(1) == type(2)", "compile:too complex"),
        ("type(1) == string", "compile:too complex"),
        ("type(optional.none()) == optional_type", "compile:too complex"),
        ("type(quantity(\"1\")) == type(quantity(\"2\"))", "compile:too complex"),
        (
            "type(semver(\"1.0.0\")) != type(quantity(\"2\"))",
            "compile:too complex",
        ),
        ("type(dyn(1)) == int", "compile:too complex"),
        (
            "string(type(1)) == \"int\"",
            "compile:found no matching overload for 'string'",
        ),
    ]);
}

#[test]
fn conversions() {
    check_cases(&[
        ("int(\"42\") == 42", "true"),
        ("int(\"-42\") == -42", "true"),
        (
            "int(\"4.2\") == 4",
            "compile:program instantiation failed: type conversion error from 'string' to '",
        ),
        ("int(4.9) == 4", "true"),
        // Not constant: evaluated, not folded.
        (
            "cel.bind(s, \"4.2\", int(s) == 4)",
            "err:type conversion error from 'string' to 'int'",
        ),
        ("cel.bind(d, 1e19, int(d) == 0)", "err:integer overflow"),
        ("int(-4.9) == -4", "true"),
        (
            "int(1e19) == 0",
            "compile:program instantiation failed: integer overflow",
        ),
        ("int(42u) == 42", "true"),
        (
            "int(18446744073709551615u) == 0",
            "compile:program instantiation failed: integer overflow",
        ),
        ("int(true) == 1", "compile:found no matching overload for 'int'"),
        ("uint(42) == 42u", "true"),
        (
            "uint(-1) == 0u",
            "compile:program instantiation failed: unsigned integer overflow",
        ),
        (
            "uint(-1.0) == 0u",
            "compile:program instantiation failed: unsigned integer overflow",
        ),
        ("uint(\"42\") == 42u", "true"),
        (
            "uint(\"+42\") == 42u",
            "compile:program instantiation failed: type conversion error from 'string' to '",
        ),
        ("uint(2.5) == 2u", "true"),
        ("double(1) == 1.0", "true"),
        ("double(2u) == 2.0", "true"),
        ("double(\"1.5\") == 1.5", "true"),
        (
            "double(\"x\") == 1.0",
            "compile:program instantiation failed: type conversion error from 'string' to '",
        ),
        ("string(1) == \"1\"", "true"),
        ("string(-1) == \"-1\"", "true"),
        ("string(42u) == \"42\"", "true"),
        ("string(1.5) == \"1.5\"", "true"),
        ("string(1e6) == \"1e+06\"", "true"),
        ("string(100000.0) == \"100000\"", "true"),
        ("string(true) == \"true\"", "true"),
        ("string(b\"abc\") == \"abc\"", "true"),
        (
            "string(b\"\\xff\") == \"\"",
            "compile:program instantiation failed: invalid UTF-8 in bytes, cannot convert t",
        ),
        ("string(\"a\") == \"a\"", "true"),
        ("string([1]) == \"\"", "compile:found no matching overload for 'string'"),
        ("bool(\"true\")", "true"),
        ("bool(\"T\")", "true"),
        ("bool(\"0\")", "false"),
        (
            "bool(\"yes\")",
            "compile:program instantiation failed: type conversion error from 'string' to '",
        ),
        ("bool(true)", "true"),
        ("bytes(\"abc\") == b\"abc\"", "true"),
        ("size(bytes(\"é\")) == 2", "true"),
        ("dyn(1) == 1", "true"),
    ]);
}

#[test]
fn literals() {
    check_cases(&[
        (r#"r"\d" == "\\d""#, "true"),
        (r#"R'\n' == "\\n""#, "true"),
        (r#""""a"b""" == 'a"b'"#, "true"),
        ("'''line1\nline2''' == \"line1\\nline2\"", "true"),
        (r#"'\x41' == "A""#, "true"),
        (r#""\u00e9" == "é""#, "true"),
        (r#""\U0001F600" == "😀""#, "true"),
        (r#""\101" == "A""#, "true"),
        (r#""\a\b\f\v\?\`" == "\x07\x08\x0c\x0b?`""#, "true"),
        (r#"size(b"\xff") == 1"#, "true"),
        (r#"size(b"\377") == 1"#, "true"),
        (r#"size(rb"\xff") == 4"#, "true"),
        (r#""\q" == "q""#, "compile:unable to unescape"),
        ("'abc", "compile:unterminated"),
        ("[1, 2, ] == [1, 2]", "true"),
        ("{\"a\": 1, } == {\"a\": 1}", "true"),
        ("{} == {}", "true"),
        ("[] == []", "true"),
        ("// comment\ntrue", "true"),
    ]);
}

#[test]
fn macros() {
    check_cases(&[
        ("[1, 2, 3].all(x, x > 0)", "true"),
        ("[1, 2, 3].all(x, x > 1)", "false"),
        ("[1, 2, 3].exists(x, x > 2)", "true"),
        ("[1, 2, 3].exists(x, x > 3)", "false"),
        ("[1, 2, 3].exists_one(x, x > 2)", "true"),
        ("[1, 2, 3].exists_one(x, x > 1)", "false"),
        ("[].all(x, x)", "true"),
        ("[].exists(x, x)", "false"),
        ("[1, 2, 3].map(x, x * 2) == [2, 4, 6]", "true"),
        ("[1, 2, 3].map(x, x > 1, x * 10) == [20, 30]", "true"),
        ("[1, 2, 3].filter(x, x % 2 == 1) == [1, 3]", "true"),
        ("[1, 2].map(x, x / 0) == []", "err:division by zero"),
        (
            "[1, 2].filter(x, x) == []",
            "compile:expected type 'bool' but found 'int'",
        ),
        ("{\"a\": 1, \"b\": 2}.all(k, k in [\"a\", \"b\"])", "true"),
        ("{\"a\": 1, \"b\": 2}.map(k, k) == [\"a\", \"b\"]", "true"),
        ("{\"a\": 1}.exists(k, v, v == 1)", "true"),
        ("[10, 20].all(i, v, v == (i + 1) * 10)", "true"),
        ("[1, 2, 1].existsOne(i, v, v == 2)", "true"),
        ("[1, 2, 1].exists_one(i, v, v == 1)", "false"),
        ("[1, 2, 3].transformList(i, v, i * v) == [0, 2, 6]", "true"),
        ("[1, 2, 3].transformList(i, v, v > 1, v) == [2, 3]", "true"),
        ("{\"a\": 1}.transformMap(k, v, v + 1) == {\"a\": 2}", "true"),
        (
            "{\"a\": 1, \"b\": 2}.transformMap(k, v, v > 1, v) == {\"b\": 2}",
            "true",
        ),
        ("[5].transformMap(i, v, v) == {0: 5}", "true"),
        ("{\"a\": 1}.transformMapEntry(k, v, {v: k}) == {1: \"a\"}", "true"),
        (
            "{\"a\": 1, \"b\": 1}.transformMapEntry(k, v, {v: k}) == {}",
            "err:already exists",
        ),
        ("[3, 1, 2].sortBy(x, -x) == [3, 2, 1]", "true"),
        ("[1, 2].all(x, [3].all(x, x == 3))", "true"),
        ("[[1, 2], [3]].exists(l, l.exists(x, x == 3))", "true"),
        ("[1, 2].all(x.y, true)", "compile:argument must be a simple name"),
        ("[1, 2].all(i, i, true)", "compile:duplicate variable name"),
        ("has(1)", "compile:invalid argument to has() macro"),
        ("has({\"a\": 1}.a)", "true"),
        ("has({\"a\": 1}.b)", "false"),
        ("has(dyn(1).b)", "false"),
        ("[1].map(x, y, x) == []", "compile:undeclared reference to 'y'"),
        ("[1].all(x, x > 0) && x > 0", "compile:undeclared reference to 'x'"),
        (
            "1.all(x, true)",
            "compile:expression of type 'int' cannot be the range of a comprehens",
        ),
        (
            "[1].existsOne(x, true)",
            "compile:undeclared reference to 'x' (in container '')",
        ),
        ("cel.bind(x, 2, x * x == 4)", "true"),
        ("cel.bind(x, 2, cel.bind(y, x + 1, x * y == 6))", "true"),
        ("cel.bind(x.y, 2, true)", "compile:simple identifiers"),
    ]);
}

#[test]
fn optionals() {
    check_cases(&[
        ("optional.of(1).value() == 1", "true"),
        ("optional.none().hasValue()", "false"),
        ("optional.none().value() == 1", "err:optional.none() dereference"),
        ("optional.none().orValue(5) == 5", "true"),
        ("optional.of(1).orValue(1 / 0) == 1", "true"),
        ("optional.none().orValue(1 / 0) == 1", "err:division by zero"),
        ("optional.of(1).or(optional.of(2)).value() == 1", "true"),
        ("optional.none().or(optional.of(2)).value() == 2", "true"),
        ("optional.of(1).or(optional.none().value()).value() == 1", "true"),
        ("optional.ofNonZeroValue(0).hasValue()", "false"),
        ("optional.ofNonZeroValue(\"\").hasValue()", "false"),
        ("optional.ofNonZeroValue([1]).hasValue()", "true"),
        ("optional.ofNonZeroValue(quantity(\"0\")).hasValue()", "true"),
        ("{\"a\": 1}.?a.value() == 1", "true"),
        ("{\"a\": 1}.?b.hasValue()", "false"),
        ("{\"a\": {\"b\": 1}}.?a.b.value() == 1", "true"),
        ("{\"a\": {\"b\": 1}}.?a.c.hasValue()", "false"),
        ("{\"a\": {\"b\": 1}}.?x.b.hasValue()", "false"),
        ("{\"a\": 1}[?\"a\"].value() == 1", "true"),
        ("[1, 2][?5].hasValue()", "false"),
        ("[1, 2][?1].value() == 2", "true"),
        ("optional.of([1])[0].value() == 1", "true"),
        ("optional.of({\"a\": 1}).a.value() == 1", "true"),
        ("optional.none().x.hasValue()", "false"),
        ("[?optional.none(), ?optional.of(1), 2] == [1, 2]", "true"),
        (
            "[?1] == [1]",
            "compile:expected type 'optional_type(int)' but found 'int'",
        ),
        ("{?\"a\": optional.none(), \"b\": 1} == {\"b\": 1}", "true"),
        ("{?\"a\": optional.of(2)} == {\"a\": 2}", "true"),
        ("optional.of(2).optMap(x, x * 2).value() == 4", "true"),
        ("optional.none().optMap(x, x * 2).hasValue()", "false"),
        ("optional.of(1).optFlatMap(x, optional.none()).hasValue()", "false"),
        ("optional.of(1).optFlatMap(x, optional.of(x + 1)).value() == 2", "true"),
        ("[1, 2].first().value() == 1", "true"),
        ("[1, 2].last().value() == 2", "true"),
        ("[].last().hasValue()", "false"),
        ("1.hasValue()", "compile:found no matching overload for 'hasValue'"),
        (
            "optional.none()",
            "compile:must evaluate to bool or the unknown type, not optional_type",
        ),
    ]);
}

#[test]
fn strings() {
    check_cases(&[
        ("\"hello\".size() == 5", "true"),
        ("size(\"héllo\") == 5", "true"),
        ("size(b\"h\\xc3\\xa9llo\") == 6", "true"),
        ("size([1, 2]) == 2", "true"),
        ("size({\"a\": 1}) == 1", "true"),
        ("size(1) == 1", "compile:found no matching overload for 'size'"),
        ("\"hello\".contains(\"ell\")", "true"),
        ("\"hello\".contains(\"\")", "true"),
        ("\"hello\".startsWith(\"he\")", "true"),
        ("\"hello\".endsWith(\"lo\")", "true"),
        ("\"hello\".endsWith(\"he\")", "false"),
        ("\"hello\".matches(\"^h.*o$\")", "true"),
        ("matches(\"hello\", \"l+\")", "true"),
        ("\"hello\".matches(\"^l+$\")", "false"),
        ("\"hello\".matches(\"(\")", "compile:error parsing regexp"),
        ("\"hello\".matches(\"(\" + \"\")", "err:error parsing regexp"),
        ("\"١٢٣\".matches(\"^\\\\d+$\")", "false"),
        ("\"hello\".charAt(1) == \"e\"", "true"),
        ("\"hello\".charAt(5) == \"\"", "true"),
        ("\"hello\".charAt(6) == \"\"", "err:index out of range: 6"),
        ("\"héllo\".charAt(1) == \"é\"", "true"),
        ("\"hello\".indexOf(\"l\") == 2", "true"),
        ("\"hello\".indexOf(\"l\", 3) == 3", "true"),
        ("\"hello\".indexOf(\"\") == 0", "true"),
        ("\"hello\".indexOf(\"x\") == -1", "true"),
        ("\"hello\".indexOf(\"l\", 10) == -1", "true"),
        ("\"hello\".indexOf(\"l\", -1) == -1", "err:index out of range: -1"),
        ("\"héllo\".indexOf(\"l\") == 2", "true"),
        ("\"hello\".lastIndexOf(\"l\") == 3", "true"),
        ("\"hello\".lastIndexOf(\"l\", 2) == 2", "true"),
        ("\"hello\".lastIndexOf(\"\") == 5", "true"),
        ("\"\".lastIndexOf(\"a\") == -1", "true"),
        ("\"hello\".lastIndexOf(\"l\", -1) == -1", "err:index out of range"),
        ("\"Hello\".lowerAscii() == \"hello\"", "true"),
        ("\"ÀB\".lowerAscii() == \"Àb\"", "true"),
        ("\"hello\".upperAscii() == \"HELLO\"", "true"),
        ("\"aaa\".replace(\"a\", \"b\") == \"bbb\"", "true"),
        ("\"aaa\".replace(\"a\", \"b\", 1) == \"baa\"", "true"),
        ("\"aaa\".replace(\"a\", \"b\", 0) == \"aaa\"", "true"),
        ("\"a,b,c\".split(\",\") == [\"a\", \"b\", \"c\"]", "true"),
        ("\"a,b,c\".split(\",\", 2) == [\"a\", \"b,c\"]", "true"),
        ("\"a,b,c\".split(\",\", 0) == []", "true"),
        ("\"hello\".substring(1) == \"ello\"", "true"),
        ("\"hello\".substring(1, 3) == \"el\"", "true"),
        ("\"hello\".substring(5) == \"\"", "true"),
        (
            "\"hello\".substring(3, 1) == \"\"",
            "err:invalid substring range. start: 3, end: 1",
        ),
        ("\"hello\".substring(6) == \"\"", "err:index out of range: 6"),
        ("\"  hi \\n\".trim() == \"hi\"", "true"),
        ("[\"a\", \"b\"].join() == \"ab\"", "compile:too complex"),
        ("[\"a\", \"b\"].join(\"-\") == \"a-b\"", "compile:too complex"),
        ("[].join(\"-\") == \"\"", "true"),
        ("[1].join() == \"\"", "compile:found no matching overload for 'join'"),
        (r#"strings.quote("a\"b\n") == "\"a\\\"b\\n\"""#, "true"),
        (
            "\"abc\".reverse() == \"cba\"",
            "compile:found no matching overload for 'reverse'",
        ),
        (
            "\"héllo\".reverse() == \"olléh\"",
            "compile:found no matching overload for 'reverse'",
        ),
        ("\"abc123def\".find(\"[0-9]+\") == \"123\"", "true"),
        ("\"abc\".find(\"[0-9]+\") == \"\"", "true"),
        ("\"a1b22c333\".findAll(\"[0-9]+\") == [\"1\", \"22\", \"333\"]", "true"),
        ("\"a1b22c333\".findAll(\"[0-9]+\", 2) == [\"1\", \"22\"]", "true"),
        ("\"abc\".findAll(\"x\").size() == 0", "true"),
        (
            "\"abc\".find(\"[\")",
            "compile:must evaluate to bool or the unknown type, not string",
        ),
        ("\"abc\".nope()", "compile:undeclared reference to 'nope'"),
        (
            "\"abc\".substring(1, 2, 3) == \"\"",
            "compile:found no matching overload for 'substring'",
        ),
        (
            "\"abc\".contains(1)",
            "compile:found no matching overload for 'contains'",
        ),
    ]);
}

#[test]
fn lists_and_sets() {
    check_cases(&[
        ("[1, 2, 3].isSorted()", "true"),
        ("[3, 1].isSorted()", "false"),
        ("[].isSorted()", "true"),
        ("[[1]].isSorted()", "compile:found no matching overload for 'isSorted'"),
        ("[1, 2, 3].sum() == 6", "true"),
        ("[1.5, 2.5].sum() == 4.0", "true"),
        ("[1u, 2u].sum() == 3u", "true"),
        ("[].sum() == 0", "true"),
        ("[9223372036854775807, 1].sum() == 0", "err:integer overflow"),
        ("[3, 1, 2].min() == 1", "true"),
        ("[3, 1, 2].max() == 3", "true"),
        ("[\"b\", \"a\"].min() == \"a\"", "compile:too complex"),
        ("[].min() == 1", "err:min called on empty list"),
        ("[].max() == 1", "err:max called on empty list"),
        ("[1, 2, 1].indexOf(1) == 0", "true"),
        ("[1, 2, 1].lastIndexOf(1) == 2", "true"),
        ("[1, 2].indexOf(3) == -1", "true"),
        ("lists.range(3) == [0, 1, 2]", "true"),
        ("lists.range(0) == []", "true"),
        ("[1, 2, 3, 4].slice(1, 3) == [2, 3]", "true"),
        ("[1, 2].slice(1, 3) == []", "err:cannot slice(1, 3), list is length 2"),
        ("[1, 2].slice(2, 1) == []", "compile:too complex"),
        ("[1, 2].slice(-1, 1) == []", "err:negative indexes not supported"),
        ("[[1], [2, 3]].flatten() == [1, 2, 3]", "true"),
        (
            "[dyn(1), dyn([dyn(2), dyn([3])])].flatten() == [dyn(1), dyn(2), dyn([3])]",
            "true",
        ),
        ("[1, [2]] == []", "compile:expected type 'int' but found 'list(int)'"),
        ("[dyn([1]), dyn([[2]])].flatten(2) == [1, 2]", "true"),
        ("[[1]].flatten(-1) == []", "err:level must be non-negative"),
        ("[1, 2, 2, 3, 1].distinct() == [1, 2, 3]", "true"),
        ("[3, 1, 2].reverse() == [2, 1, 3]", "true"),
        ("[3, 1, 2].sort() == [1, 2, 3]", "true"),
        ("[\"b\", \"a\"].sort() == [\"a\", \"b\"]", "true"),
        (
            "[dyn(1), dyn(\"a\")].sort() == []",
            "err:list elements must have the same type",
        ),
        ("[[1]].sort() == []", "compile:found no matching overload for 'sort'"),
        ("sets.contains([1, 2, 3], [1, 2])", "true"),
        ("sets.contains([1], [2])", "false"),
        (
            "sets.contains([1, 2], [1.0])",
            "compile:found no matching overload for 'sets.contains'",
        ),
        ("sets.contains([1], [])", "true"),
        ("sets.equivalent([1, 2], [2, 1, 1])", "true"),
        ("sets.equivalent([1, 2], [1])", "false"),
        ("sets.intersects([1, 2], [2, 3])", "true"),
        ("sets.intersects([1], [2])", "false"),
        ("sets.nope([1], [2])", "compile:undeclared reference to 'sets'"),
    ]);
}

#[test]
fn quantities() {
    check_cases(&[
        ("quantity(\"1Gi\") == quantity(\"1024Mi\")", "true"),
        ("quantity(\"1G\") != quantity(\"1Gi\")", "compile:too complex"),
        ("quantity(\"1k\").isInteger()", "true"),
        ("quantity(\"1.5\").isInteger()", "false"),
        (
            "quantity(\"1.5\").asInteger() == 1",
            "err:cannot convert value to integer",
        ),
        ("quantity(\"50k\").asInteger() == 50000", "true"),
        ("quantity(\"1.5\").asApproximateFloat() == 1.5", "true"),
        (
            "quantity(\"-1\").sign() == -1",
            "compile:found no matching overload for 'sign'",
        ),
        (
            "quantity(\"0\").sign() == 0",
            "compile:found no matching overload for 'sign'",
        ),
        ("sign(quantity(\"5\")) == 1", "true"),
        ("quantity(\"50k\").add(quantity(\"20k\")) == quantity(\"70k\")", "true"),
        ("quantity(\"50k\").add(20) == quantity(\"50020\")", "true"),
        ("quantity(\"50k\").sub(20000) == quantity(\"30k\")", "true"),
        ("quantity(\"50k\").sub(quantity(\"20k\")) == quantity(\"30k\")", "true"),
        (
            "quantity(\"50k\").add(20).sub(quantity(\"100k\")).sub(-50000) == quantity(\"20\")",
            "true",
        ),
        (
            "quantity(\"2\").mul(3) == quantity(\"6\")",
            "compile:undeclared reference to 'mul' (in container '')",
        ),
        ("quantity(\"200M\").compareTo(quantity(\"0.2G\")) == 0", "true"),
        ("quantity(\"50M\").compareTo(quantity(\"50Mi\")) == -1", "true"),
        ("quantity(\"50Mi\").compareTo(quantity(\"50M\")) == 1", "true"),
        ("quantity(\"150Mi\").isGreaterThan(quantity(\"100Mi\"))", "true"),
        ("quantity(\"50Mi\").isGreaterThan(quantity(\"100Mi\"))", "false"),
        ("quantity(\"50M\").isLessThan(quantity(\"100M\"))", "true"),
        ("isQuantity(\"1.3Gi\")", "true"),
        ("isQuantity(\"200K\")", "false"),
        ("isQuantity(\"Three\")", "false"),
        (
            "quantity(\"200K\") == quantity(\"1\")",
            "err:quantities must match the regular expression",
        ),
        (
            "quantity(\"1\") < quantity(\"2\")",
            "compile:found no matching overload for '_<_'",
        ),
        (
            "quantity(\"1\").isGreaterThan(1)",
            "compile:found no matching overload for 'isGreaterThan'",
        ),
        (
            "quantity(1) == quantity(\"1\")",
            "compile:found no matching overload for 'quantity'",
        ),
        (
            "quantity(\"1\").major() == 1",
            "compile:found no matching overload for 'major'",
        ),
    ]);
}

#[test]
fn semantic_versions() {
    check_cases(&[
        ("semver(\"1.2.3\").major() == 1", "true"),
        ("semver(\"1.2.3\").minor() == 2", "true"),
        ("semver(\"1.2.3\").patch() == 3", "true"),
        ("semver(\"1.0.0\") == semver(\"1.0.0+build\")", "true"),
        ("semver(\"1.0.0\") == semver(\"1.0.1\")", "false"),
        ("semver(\"1.0.0-alpha\").isLessThan(semver(\"1.0.0\"))", "true"),
        (
            "semver(\"1.0.0-alpha.1\").isLessThan(semver(\"1.0.0-alpha.beta\"))",
            "true",
        ),
        ("semver(\"1.0.0-beta.2\").isLessThan(semver(\"1.0.0-beta.11\"))", "true"),
        ("semver(\"2.0.0\").isGreaterThan(semver(\"1.9.9\"))", "true"),
        ("semver(\"1.2.3\").compareTo(semver(\"1.2.3\")) == 0", "true"),
        ("semver(\"1.2.3\").compareTo(semver(\"2.0.0\")) == -1", "true"),
        ("semver(\"1.2.3\").compareTo(semver(\"0.1.2\")) == 1", "true"),
        ("semver(\"v1.0\", true) == semver(\"1.0.0\")", "true"),
        ("semver(\"01.01.01\", true) == semver(\"1.1.1\")", "true"),
        (
            "semver(\"v1.0.0\") == semver(\"1.0.0\")",
            "err:Invalid character(s) found in major number",
        ),
        (
            "semver(\"v1.0\") == semver(\"1.0.0\")",
            "err:No Major.Minor.Patch elements found",
        ),
        (
            "semver(\"1.0\") == semver(\"1.0.0\")",
            "err:No Major.Minor.Patch elements found",
        ),
        ("semver(\"01.0.0\") == semver(\"1.0.0\")", "err:leading zeroes"),
        ("isSemver(\"1.0.0\")", "true"),
        ("isSemver(\"1.0.0-rc.1+build.5\")", "true"),
        ("isSemver(\"v1.0\")", "false"),
        ("isSemver(\"v1.0\", true)", "true"),
        ("isSemver(\"1.0.0-01\")", "false"),
        ("isSemver(\"1.0.0-a_b\")", "false"),
        (
            "semver(\"1.0.0\").isGreaterThan(quantity(\"1\"))",
            "compile:found no matching overload for 'isGreaterThan'",
        ),
        (
            "semver(\"1.0.0\") < semver(\"2.0.0\")",
            "compile:found no matching overload for '_<_'",
        ),
    ]);
}

#[test]
fn compile_errors() {
    check_cases(&[
        ("x == 1", "compile:undeclared reference to 'x'"),
        ("foo(1)", "compile:undeclared reference to 'foo'"),
        ("size(1, 2)", "compile:found no matching overload for 'size'"),
        ("\"a\".quantity()", "compile:found no matching overload for 'quantity'"),
        ("1 +", "compile:Syntax error"),
        ("(1 == 1", "compile:Syntax error"),
        ("1 == 1)", "compile:Syntax error"),
        ("1 = 1", "compile:token recognition error"),
        ("a.b{c: 1}", "compile:Syntax error"),
        ("Foo{c: 1}", "compile:not supported"),
        ("while == 1", "compile:reserved identifier: while"),
        ("", "compile:Syntax error"),
        ("device.", "compile:Syntax error"),
        ("[1, 2", "compile:Syntax error"),
        (
            "\"%d\".format([\"a\"]) == \"1\"",
            "compile:decimal clause can only be used on integers, was given string",
        ),
        ("\"%d %d\".format([1]) == \"1\"", "compile:index 1 out of range"),
        (
            "\"%d\".format([1, 2]) == \"1\"",
            "compile:too many arguments supplied to string.format (expected 1, got 2)",
        ),
        (
            "timestamp(\"2024-13-01T00:00:00Z\") > timestamp(0)",
            "compile:invalid timestamp argument",
        ),
        (
            "duration(\"1d\") > duration(\"1h\")",
            "compile:invalid duration argument",
        ),
        (
            "timestamp(253402300800) > timestamp(0)",
            "compile:invalid timestamp argument",
        ),
        ("timestamp(\"bad\" + \"\") > timestamp(0)", "err:type conversion error"),
        ("1 == 1 == true", "true"),
    ]);
    let err = compile("1 +\n  x").unwrap_err();
    assert!(
        err.message
            .starts_with("ERROR: <input>:2:3: undeclared reference to 'x'"),
        "{}",
        err.message
    );
    assert!(err.message.ends_with(" | ..^"), "{}", err.message);
}

#[test]
fn limits() {
    let fixture = Fixture::new();
    let device = fixture.view();
    let nested = |open: &str, close: &str, n: usize| format!("{}true{}", open.repeat(n), close.repeat(n));
    assert_eq!(outcome(&nested("(", ")", 100), &device), "true");
    assert!(outcome(&nested("(", ")", 300), &device).contains("recursion limit exceeded"));
    assert!(outcome(&format!("{} == []", nested("[", "]", 300)), &device).contains("recursion limit exceeded"));
    let chain = vec!["1"; 300].join(" + ");
    assert!(outcome(&format!("{chain} > 0"), &device).contains("recursion limit exceeded"));
    let members = format!("{{}}{} == 1", ".a".repeat(300));
    assert!(outcome(&members, &device).contains("recursion limit exceeded"));
    // Logical chains are balanced, as in cel-go, and stay shallow.
    let conjunction = vec!["true"; 1200].join(" && ");
    assert_eq!(outcome(&conjunction, &device), "true");
    // Unary operators fold without nesting.
    assert_eq!(outcome(&format!("{}true", "!".repeat(4000)), &device), "true");
    let long = format!("\"{}\" == \"\"", "a".repeat(MAX_EXPRESSION_LENGTH));
    assert!(outcome(&long, &device).contains("too long"));
    // Deepest accepted nesting evaluates without exhausting the stack.
    let deep = format!("{}1{} == [dyn(1)]", "[".repeat(240), "]".repeat(240));
    assert_eq!(outcome(&deep, &device), "false");
    let deep_calls = format!("{}true{}", "!(".repeat(120), ")".repeat(120));
    assert_eq!(outcome(&deep_calls, &device), "true");
    let nested = |open: &dyn Fn(usize) -> String, n: usize| (0..n).map(open).collect::<String>();
    let comprehensions = format!("{}true{}", nested(&|i| format!("[1].all(x{i}, "), 240), ")".repeat(240));
    assert_eq!(outcome(&comprehensions, &device), "true");
    let binds = format!(
        "{}true{}",
        nested(&|i| format!("cel.bind(x{i}, 1, "), 240),
        ")".repeat(240)
    );
    assert_eq!(outcome(&binds, &device), "true");
}

#[test]
fn cost_limit() {
    check_cases(&[
        ("lists.range(100).all(i, lists.range(100).all(j, i + j >= 0))", "true"),
        (
            "lists.range(1000).all(i, lists.range(1000).all(j, i + j >= 0))",
            "compile:too complex",
        ),
        ("lists.range(2000000).size() > 0", "compile:too complex"),
        // The cost limit is not an ordinary error: `||` does not absorb it.
        (
            "lists.range(1000).exists(i, lists.range(1000).all(j, j >= 0) && false) || true",
            "compile:too complex",
        ),
        (
            "cel.bind(a, \"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\", lists.range(30).map(i, a).join().size() > 0)",
            "compile:too complex",
        ),
        (
            "lists.range(100000).map(i, \"x\").join().size() == 100000",
            "compile:too complex",
        ),
        // Lookups in large computed maps are linear scans and are charged as such.
        (
            "cel.bind(m, lists.range(20000).transformMap(i, v, v), lists.range(20000).all(i, m[i] == i))",
            "err:actual cost limit exceeded",
        ),
        (
            "lists.range(100000).transformMapEntry(i, v, {v: i}).size() > 0",
            "compile:too complex",
        ),
        (
            "cel.bind(m, lists.range(100).transformMap(i, v, v), lists.range(100).all(i, m[i] == i))",
            "true",
        ),
    ]);
    // Repeated doubling of a string is stopped by the per-byte cost.
    let mut expr = String::from("\"0123456789\"");
    for _ in 0..40 {
        expr = format!("cel.bind(s, {expr}, s + s)");
    }
    let fixture = Fixture::new();
    assert!(outcome(&format!("size({expr}) > 0"), &fixture.view()).contains("cost limit"));
}

/// What the checker refuses, evaluated through `dyn`: the runtime keeps cel-go's
/// dynamic semantics.
#[test]
fn dynamic_values_keep_runtime_semantics() {
    check_cases(&[
        ("dyn(1) == 1.0", "true"),
        ("dyn(1) == 1u", "true"),
        ("dyn(1u) == 1.0", "true"),
        ("dyn(1.0) != 1", "false"),
        ("dyn(1) == \"1\"", "false"),
        ("dyn(null) == 0", "false"),
        ("dyn(1) + 1.0 == 2.0", "err:no such overload"),
        ("dyn(1) + 1u == 2u", "err:no such overload"),
        ("dyn(5.0) % dyn(2.0) == dyn(1.0)", "err:no such overload"),
        ("dyn(\"a\") < 1", "err:no such overload"),
        ("!dyn(1)", "err:no such overload"),
        ("dyn(1) && false", "false"),
        ("dyn(1) || true", "true"),
        ("dyn(1) && true", "err:no such overload"),
        ("[1] == [dyn(1.0)]", "true"),
        ("{\"a\": 1} == {\"a\": dyn(1.0)}", "true"),
        ("{1: \"a\"}[dyn(1u)] == \"a\"", "true"),
        ("{1: \"a\"}[dyn(1.0)] == \"a\"", "true"),
        ("[1, 2][dyn(1u)] == 2", "true"),
        ("[1, 2][dyn(\"a\")] == 2", "err:unsupported index type"),
        ("dyn(\"abc\")[0] == \"a\"", "err:no such overload"),
        ("dyn(1).foo == 1", "err:does not support field selection"),
        ("dyn(2.0) in [1, 2]", "true"),
        ("dyn(1) in device.attributes[\"gpu.example.com\"]", "false"),
        ("[dyn([1])].flatten().isSorted()", "true"),
        ("[dyn(1)].all(x, x)", "err:no such overload"),
        ("dyn(1).all(x, true)", "err:cannot be the range of a comprehension"),
        (
            "[?dyn(1)] == [1]",
            "compile:an optional element of type dyn: the API server fails on it",
        ),
        ("dyn(1).hasValue()", "err:no such overload"),
        ("quantity(\"1\") == dyn(1)", "false"),
        ("dyn(quantity(\"1\")).isGreaterThan(dyn(1))", "err:no such overload"),
        ("sets.contains([1, 2], [dyn(1.0)])", "true"),
        (
            "[dyn(1), dyn(\"a\")].sort() == []",
            "err:list elements must have the same type",
        ),
    ]);
}

/// The runtime meter stops what the estimate would not (it bounds every evaluation).
#[test]
fn runtime_cost_meter() {
    let fixture = Fixture::new();
    let device = fixture.view();
    let program = compile("lists.range(1000).all(i, lists.range(100).all(j, i + j >= 0))").unwrap();
    assert_eq!(program.evaluate(&device), Ok(true));
    let err = program.evaluate_with_limit(&device, 10_000).unwrap_err();
    assert!(err.message.contains("actual cost limit exceeded"), "{}", err.message);
    // The limit is not an ordinary error: `||` does not absorb it.
    let program = compile("lists.range(1000).exists(i, lists.range(100).all(j, j >= 0) && false) || true").unwrap();
    let err = program.evaluate_with_limit(&device, 10_000).unwrap_err();
    assert!(err.message.contains("actual cost limit exceeded"), "{}", err.message);
}

#[test]
fn lazy_attribute_view() {
    // Many attributes, one of them an unparsable version that upstream would reject
    // while building its map: a selector that does not touch it neither fails nor pays
    // for the size of the device.
    let mut attributes = Attributes::new();
    for i in 0..10_000 {
        attributes.insert(format!("attr{i}"), AttributeValue::Int(i));
    }
    attributes.insert("model".into(), AttributeValue::String("H100".into()));
    attributes.insert("broken".into(), AttributeValue::Version("not-a-version".into()));
    let capacity = NameMap::<Quantity>::new();
    let device = DeviceView {
        driver: "gpu.example.com",
        attributes: &attributes,
        capacity: &capacity,
        allow_multiple_allocations: false,
    };
    let program = compile(r#"device.attributes["gpu.example.com"].model == "H100""#).unwrap();
    assert_eq!(program.evaluate(&device), Ok(true));
    // Cost is a handful of units, independent of the 10,002 attributes.
    assert_eq!(program.evaluate_with_limit(&device, 10), Ok(true));
    let touch = compile(r#"device.attributes["gpu.example.com"].broken.major() == 1"#).unwrap();
    assert!(
        touch
            .evaluate(&device)
            .unwrap_err()
            .message
            .contains("parse semantic version")
    );
    let size = compile(r#"size(device.attributes["gpu.example.com"]) == 10002"#).unwrap();
    assert_eq!(size.evaluate(&device), Ok(true));
}

#[test]
fn programs_are_shareable() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<Program>();
    let program = compile("device.allowMultipleAllocations").unwrap();
    assert_eq!(program.expression(), "device.allowMultipleAllocations");
    let fixture = Fixture::new();
    let clone = program.clone();
    let handle = std::thread::spawn(move || {
        let fixture = Fixture::new();
        clone.evaluate(&fixture.view())
    });
    assert_eq!(handle.join().unwrap(), Ok(true));
    assert_eq!(program.evaluate(&fixture.view()), Ok(true));
}

#[test]
fn timestamps_and_durations() {
    check_cases(&[
        ("timestamp(\"2024-01-01T00:00:00Z\") > timestamp(0)", "true"),
        ("timestamp(\"2024-01-01T00:00:00Z\").getFullYear() == 2024", "true"),
        ("timestamp(\"2024-03-01T10:20:30Z\").getMonth() == 2", "true"),
        ("timestamp(\"2024-03-01T10:20:30Z\").getHours(\"+02:00\") == 12", "true"),
        ("timestamp(\"2024-03-01T10:20:30Z\").getHours(\"-02:30\") == 7", "true"),
        ("timestamp(\"2024-03-01T10:20:30+02:00\").getHours() == 8", "true"),
        ("timestamp(\"2024-12-31T23:00:00Z\").getDayOfYear() == 365", "true"),
        ("timestamp(\"2024-03-01T00:00:00Z\").getDayOfMonth() == 0", "true"),
        ("timestamp(\"2024-03-01T00:00:00Z\").getDate() == 1", "true"),
        ("timestamp(\"2024-03-03T00:00:00Z\").getDayOfWeek() == 0", "true"),
        (
            "timestamp(\"2024-03-03T00:00:00.123Z\").getMilliseconds() == 123",
            "true",
        ),
        (
            "timestamp(\"2024-03-03T00:00:00Z\").getHours(\"x:00\") == 0",
            "err:invalid syntax",
        ),
        (
            "timestamp(\"2024-03-03T00:00:00Z\").getHours(\"Nowhere/City\") == 0",
            "err:unknown time zone",
        ),
        ("duration(\"1h30m\") == duration(\"90m\")", "true"),
        ("duration(\"1h\").getMinutes() == 60", "true"),
        ("duration(\"-1.5h\").getHours() == -1", "true"),
        ("duration(\"3723.5s\").getMilliseconds() == 3723500", "true"),
        (
            "timestamp(\"2024-01-01T00:00:00Z\") + duration(\"24h\") == timestamp(\"2024-01-02T00:00:00Z\")",
            "true",
        ),
        (
            "timestamp(\"2024-01-02T00:00:00Z\") - timestamp(\"2024-01-01T00:00:00Z\") == duration(\"24h\")",
            "true",
        ),
        ("string(duration(\"1h30m\")) == \"5400s\"", "true"),
        (
            "string(timestamp(\"2024-01-01T10:00:00.50+02:00\")) == \"2024-01-01T10:00:00.5+02:00\"",
            "true",
        ),
        ("int(timestamp(\"1970-01-01T00:00:01Z\")) == 1", "true"),
        ("int(duration(\"1s\")) == 1000000000", "true"),
        (
            "timestamp(\"9999-12-31T23:59:59Z\") + duration(\"1s\") > timestamp(0)",
            "err:timestamp overflow",
        ),
        (
            "duration(\"2562047h\") + duration(\"2562047h\") > duration(\"0s\")",
            "err:integer overflow",
        ),
        (
            "[duration(\"2s\"), duration(\"1s\")].sort()[0] == duration(\"1s\")",
            "true",
        ),
        ("[duration(\"2s\"), duration(\"1s\")].sum() == duration(\"3s\")", "true"),
        ("type(timestamp(0)) == google.protobuf.Timestamp", "compile:too complex"),
        ("[type(timestamp(0))] == [google.protobuf.Timestamp]", "true"),
        ("optional.ofNonZeroValue(duration(\"0s\")).hasValue()", "false"),
        ("dyn(duration(\"1h\")).getHours(\"UTC\") == 1", "err:no such overload"),
        (
            "duration(\"1h\").getHours(\"UTC\") == 1",
            "compile:found no matching overload",
        ),
        ("timestamp(0) == duration(\"0s\")", "compile:found no matching overload"),
    ]);
}

#[test]
fn ips_and_cidrs() {
    check_cases(&[
        ("ip(\"10.0.0.1\").family() == 4", "true"),
        ("ip(\"::1\").family() == 6 && ip(\"::1\").isLoopback()", "true"),
        ("ip(\"10.0.0.1\").isGlobalUnicast()", "true"),
        ("ip(\"0.0.0.0\").isUnspecified()", "true"),
        ("ip(\"169.254.1.1\").isLinkLocalUnicast()", "true"),
        ("ip(\"224.0.0.1\").isLinkLocalMulticast()", "true"),
        ("isIP(\"10.0.0.256\")", "false"),
        ("isIP(\"fe80::1%eth0\")", "false"),
        ("ip(\"010.0.0.1\").family() == 4", "err:leading zero"),
        ("ip(\"::ffff:1.2.3.4\").family() == 6", "err:IPv4-mapped"),
        ("ip.isCanonical(\"2001:db8::1\")", "true"),
        ("ip.isCanonical(\"2001:DB8::1\")", "false"),
        ("ip.isCanonical(\"nope\")", "err:parse error"),
        ("string(ip(\"2001:0db8:0:0:0:0:0:1\")) == \"2001:db8::1\"", "true"),
        ("ip(\"10.0.0.1\") == ip(\"10.0.0.1\")", "true"),
        ("cidr(\"10.0.0.0/8\").containsIP(ip(\"10.1.2.3\"))", "true"),
        ("cidr(\"10.0.0.0/8\").containsIP(\"11.1.2.3\")", "false"),
        ("cidr(\"10.0.0.0/8\").containsIP(\"nope\")", "err:no such overload"),
        ("cidr(\"10.0.0.0/8\").containsCIDR(\"10.1.0.0/16\")", "true"),
        ("cidr(\"10.0.0.0/8\").containsCIDR(cidr(\"0.0.0.0/0\"))", "false"),
        ("cidr(\"10.1.2.3/8\").masked() == cidr(\"10.0.0.0/8\")", "true"),
        ("cidr(\"10.1.2.3/8\") == cidr(\"10.0.0.0/8\")", "false"),
        ("cidr(\"10.0.0.0/8\").prefixLength() == 8", "true"),
        ("cidr(\"10.0.0.0/8\").ip() == ip(\"10.0.0.0\")", "true"),
        ("string(cidr(\"2001:db8::/32\")) == \"2001:db8::/32\"", "true"),
        ("isCIDR(\"10.0.0.0/33\")", "false"),
        ("cidr(\"10.0.0.0/08\").prefixLength() == 8", "err:bad bits"),
        (
            "[type(ip(\"::\"))] == [net.IP] && [type(cidr(\"::/0\"))] == [net.CIDR]",
            "true",
        ),
    ]);
}

#[test]
fn a_stored_selector_is_not_held_to_the_cost_estimate_a_new_one_is() {
    // The estimator cannot bound `type(1)`'s size; the API server refuses it as new.
    let expression = r#"type(1) == int && device.driver == "gpu.example.com""#;
    let refused = compile(expression).unwrap_err();
    assert!(refused.message.contains("exceeds cost limit"), "{}", refused.message);
    let fixture = Fixture::new();
    let stored = compile_stored(expression).expect("kube-scheduler compiles stored selectors without the estimate");
    assert_eq!(stored.evaluate(&fixture.view()), Ok(true));
}

#[test]
fn urls() {
    check_cases(&[
        (
            r#"url("https://user:pass@example.com:80/path?query=val#fragment").getHost() == "example.com:80""#,
            "true",
        ),
        (r#"url("/absolute-path").getScheme() == """#, "true"),
        (
            r#"url("https://a:b:c/").getScheme() == "https""#,
            "err:URL parse error during conversion from string: parse \"https://a:b:c/\": invalid port \":b:c\" after host",
        ),
        (
            r#"url("../relative-path").getScheme() == """#,
            "err:invalid URI for request",
        ),
        (
            r#"isURL("https://user:pass@example.com:80/path?query=val#fragment")"#,
            "true",
        ),
        (r#"isURL("/absolute-path")"#, "true"),
        (r#"isURL("https://a:b:c/")"#, "false"),
        (r#"isURL("../relative-path")"#, "false"),
        (r#"url("https://example.com/").getScheme() == "https""#, "true"),
        (r#"url("https://example.com/").getHost() == "example.com""#, "true"),
        (r#"url("https://[::1]:80/").getHost() == "[::1]:80""#, "true"),
        (r#"url("https://[::1]/").getHost() == "[::1]""#, "true"),
        (r#"url("/path").getHost() == """#, "true"),
        (
            r#"url("https://example.com:80/").getHostname() == "example.com""#,
            "true",
        ),
        (r#"url("https://127.0.0.1:80/").getHostname() == "127.0.0.1""#, "true"),
        (r#"url("https://[::1]:80/").getHostname() == "::1""#, "true"),
        (r#"url("https://example.com:80/").getPort() == "80""#, "true"),
        (r#"url("https://example.com/").getPort() == """#, "true"),
        (
            r#"url("https://example.com/path with spaces/").getEscapedPath() == "/path%20with%20spaces/""#,
            "true",
        ),
        (r#"url("https://example.com").getEscapedPath() == """#, "true"),
        (
            r#"url("https://example.com/path?k1=a&k2=b&k2=c").getQuery() == {"k1": ["a"], "k2": ["b", "c"]}"#,
            "true",
        ),
        (
            r#"url("https://example.com/path?key with spaces=value with spaces").getQuery() == {"key with spaces": ["value with spaces"]}"#,
            "true",
        ),
        (r#"url("https://example.com/path?").getQuery() == {}"#, "true"),
        (r#"url("https://example.com/path").getQuery().size() == 0"#, "true"),
        (
            r#"url("https://example.com/a") == url("https://example.com/a")"#,
            "true",
        ),
        (
            r#"url("https://example.com/a") != url("https://example.com/b")"#,
            "true",
        ),
        (
            r#"url("HTTPS://example.com/a") == url("https://example.com/a")"#,
            "true",
        ),
        (r#"dyn(url("/a")) == 1"#, "err:no such overload"),
        (r#"dyn(1) == dyn(url("/a"))"#, "false"),
        (r#"dyn(url("/a")) == null"#, "false"),
        (r#"[dyn(url("/a"))] == [dyn(1)]"#, "true"),
        (r#"dyn(url("/a")) in [1, 2]"#, "false"),
        (r#"url("/a") in [url("/b"), url("/a")]"#, "true"),
        // The library registers the type but declares no identifier for it.
        (
            r#"[type(url("/a"))] == [kubernetes.URL]"#,
            "compile:undeclared reference to 'kubernetes'",
        ),
        (r#"[type(url("/a"))] == [type(url("/b"))]"#, "true"),
        (r#"dyn(url("/a")) != 1"#, "true"),
        // List searches never fail on a URL compared with another type.
        (r#"[dyn(url("/a")), dyn(1)].indexOf(dyn(1)) == 1"#, "true"),
        (r#"sets.contains([dyn(url("/a")), dyn(1)], [dyn(1)])"#, "true"),
        // A URL map key is its pointer; no URL indexes anything.
        (r#"cel.bind(u, url("/a"), u in {u: 1})"#, "true"),
        (r#"url("/a") in {url("/a"): 1}"#, "false"),
        (
            r#"cel.bind(u, url("/a"), {u: 1}[u] == 1)"#,
            "err:invalid qualifier type: cel.URL",
        ),
        (r#"url(1) == url("/a")"#, "compile:found no matching overload for 'url'"),
        (
            r#"string(url("/a")) == "/a""#,
            "compile:found no matching overload for 'string'",
        ),
        (
            r#"url("/a").getScheme("x") == """#,
            "compile:found no matching overload for 'getScheme'",
        ),
    ]);
}

#[test]
fn named_formats() {
    check_cases(&[
        (r#"!format.dns1123Label().validate("my-label-name").hasValue()"#, "true"),
        (
            r#"format.dns1123Label().validate("My_Label").value().size() == 1"#,
            "true",
        ),
        (
            r#"format.dns1123Label().validate("a.b").value() == ["must not contain dots"]"#,
            "true",
        ),
        (
            r#"!format.dns1123Subdomain().validate("apiextensions.k8s.io").hasValue()"#,
            "true",
        ),
        (r#"!format.dns1035Label().validate("my-label-name").hasValue()"#, "true"),
        (
            r#"!format.qualifiedName().validate("apiextensions.k8s.io/v1beta1").hasValue()"#,
            "true",
        ),
        (
            r#"!format.dns1123LabelPrefix().validate("my-label-prefix-").hasValue()"#,
            "true",
        ),
        (
            r#"!format.dns1123SubdomainPrefix().validate("mysubdomain.prefix.-").hasValue()"#,
            "true",
        ),
        (
            r#"!format.dns1035LabelPrefix().validate("my-label-prefix-").hasValue()"#,
            "true",
        ),
        (r#"!format.uri().validate("http://example.com").hasValue()"#, "true"),
        (
            r#"format.uri().validate("x").value() == ["parse \"x\": invalid URI for request"]"#,
            "true",
        ),
        (
            r#"!format.uuid().validate("123e4567-e89b-12d3-a456-426614174000").hasValue()"#,
            "true",
        ),
        (
            r#"format.uuid().validate("x").value() == ["does not match the UUID format"]"#,
            "true",
        ),
        (r#"!format.byte().validate("aGVsbG8=").hasValue()"#, "true"),
        (
            r#"format.byte().validate("aGVsbG8").value() == ["invalid base64"]"#,
            "true",
        ),
        (r#"!format.date().validate("2021-01-01").hasValue()"#, "true"),
        (
            r#"format.date().validate("2021-02-30").value() == ["invalid date"]"#,
            "true",
        ),
        (
            r#"!format.datetime().validate("2021-01-01T00:00:00Z").hasValue()"#,
            "true",
        ),
        (
            r#"format.datetime().validate("2021-01-01").value() == ["invalid datetime"]"#,
            "true",
        ),
        (r#"!format.labelValue().validate("").hasValue()"#, "true"),
        (r#"format.named("uuid").hasValue()"#, "true"),
        (r#"format.named("nope").hasValue()"#, "false"),
        (r#"format.named("uuid").value() == format.uuid()"#, "true"),
        (r#"format.uuid() == format.byte()"#, "false"),
        // Without an estimate for `!=` on formats the API server's is unbounded.
        (r#"format.uuid() != format.byte()"#, "compile:too complex"),
        (r#"dyn(format.uuid()) == "uuid""#, "err:no such overload"),
        (
            r#"[type(format.uuid())] == [kubernetes.NamedFormat]"#,
            "compile:undeclared reference to 'kubernetes'",
        ),
        (r#"format.named("uuid").value().validate("x").hasValue()"#, "true"),
        (
            r#"format.nope().validate("x").hasValue()"#,
            "compile:undeclared reference to 'format'",
        ),
        (
            r#"format.uuid().validate(1).hasValue()"#,
            "compile:found no matching overload for 'validate'",
        ),
    ]);
}

#[test]
fn string_format() {
    check_cases(&[
        (r#""%s-%d".format(["a", 1]) == "a-1""#, "true"),
        (r#""%.2f".format([1234.5]) == "1,234.50""#, "true"),
        (r#""%e".format([1052.033]) == "1.052033\u00d710\u2070\u00b3""#, "true"),
        (
            r#""%s".format([{"b": [1.5], "a": b"x"}]) == "{\"a\":b\"x\", \"b\":[1.500000]}""#,
            "true",
        ),
        (
            r#""%b %o %x %X".format([-5, 8u, "hi", 255]) == "-101 10 6869 FF""#,
            "true",
        ),
        // Only literal calls are checked when compiling; the others fail at run time.
        (r#"device.driver.format(["x"]) == "gpu.example.com""#, "true"),
        (r#"("%" + "d").format(["x"]) == """#, "err:decimal clause"),
        (r#""%d".format([1] + [2]) == "1""#, "true"),
        (
            r#""%s".format([device.attributes["gpu.example.com"].model]) == """#,
            "compile:google.protobuf.Any",
        ),
        (
            r#""%s".format([dyn(device.attributes["gpu.example.com"].model)]) == "H100""#,
            "true",
        ),
    ]);
}
