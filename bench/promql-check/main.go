// Command promql-check holds the dashboard picture's PromQL evaluator to Prometheus's
// own engine: it reads the values file the dashboard tool writes (`--values`), loads the
// same samples (staleness markers included) into a Prometheus TSDB, runs every query as
// a range query with Prometheus's engine, and compares each point with the tool's.
//
//	cargo run --release -p muster-bench --bin dashboard -- --replay --values target/dashboard/values.json
//	(cd bench/promql-check && go run . < ../../target/dashboard/values.json)
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/value"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/tsdb"
)

type sample struct {
	T int64    `json:"t"`
	V *float64 `json:"v"` // nil: a staleness marker
}

type storedSeries struct {
	Labels map[string]string `json:"labels"`
	Points []sample          `json:"points"`
}

type query struct {
	Expr  string `json:"expr"`
	Start int64  `json:"start"`
	End   int64  `json:"end"`
	Step  int64  `json:"step"`
}

type resultSeries struct {
	Labels map[string]string `json:"labels"`
	Points [][2]any          `json:"points"`
}

type result struct {
	Expr   string         `json:"expr"`
	Series []resultSeries `json:"series"`
}

type values struct {
	Series  []storedSeries `json:"series"`
	Queries []query        `json:"queries"`
	Results []result       `json:"results"`
}

// number reads a value as the tool writes it: a number, or "NaN", "inf", "-inf".
func number(v any) float64 {
	switch x := v.(type) {
	case float64:
		return x
	case string:
		f, err := strconv.ParseFloat(strings.Replace(x, "inf", "Inf", 1), 64)
		if err != nil {
			panic(fmt.Sprintf("value %q: %v", x, err))
		}
		return f
	}
	panic(fmt.Sprintf("value %v", v))
}

func key(ls map[string]string) string {
	return labels.FromMap(ls).String()
}

func same(a, b float64) bool {
	if math.IsNaN(a) || math.IsNaN(b) {
		return math.IsNaN(a) && math.IsNaN(b)
	}
	if a == b {
		return true
	}
	return math.Abs(a-b) <= 1e-9*math.Max(math.Abs(a), math.Abs(b))
}

func main() {
	var in values
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fail("reading the values: %v", err)
	}
	dir, err := os.MkdirTemp("", "promql-check")
	if err != nil {
		fail("%v", err)
	}
	defer os.RemoveAll(dir)
	db, err := tsdb.Open(dir, nil, nil, tsdb.DefaultOptions(), nil)
	if err != nil {
		fail("opening a TSDB: %v", err)
	}
	defer db.Close()
	app := db.Appender(context.Background())
	for _, s := range in.Series {
		ls := labels.FromMap(s.Labels)
		for _, p := range s.Points {
			v := math.Float64frombits(value.StaleNaN)
			if p.V != nil {
				v = *p.V
			}
			if _, err := app.Append(0, ls, p.T, v); err != nil {
				fail("appending %s at %d: %v", ls, p.T, err)
			}
		}
	}
	if err := app.Commit(); err != nil {
		fail("%v", err)
	}
	engine := promql.NewEngine(promql.EngineOpts{
		MaxSamples:    100_000_000,
		Timeout:       time.Minute,
		LookbackDelta: 5 * time.Minute,
	})
	points, mismatches := 0, 0
	report := func(format string, args ...any) {
		mismatches++
		if mismatches <= 20 {
			fmt.Printf(format+"\n", args...)
		}
	}
	for i, q := range in.Queries {
		qry, err := engine.NewRangeQuery(context.Background(), db, nil, q.Expr,
			time.UnixMilli(q.Start), time.UnixMilli(q.End), time.Duration(q.Step)*time.Millisecond)
		if err != nil {
			fail("%s: %v", q.Expr, err)
		}
		res := qry.Exec(context.Background())
		if res.Err != nil {
			fail("%s: %v", q.Expr, res.Err)
		}
		matrix, err := res.Matrix()
		if err != nil {
			fail("%s: %v", q.Expr, err)
		}
		want := map[string]map[int64]float64{}
		for _, s := range matrix {
			points := map[int64]float64{}
			for _, f := range s.Floats {
				points[f.T] = f.F
			}
			want[s.Metric.String()] = points
		}
		got := map[string]map[int64]float64{}
		for _, s := range in.Results[i].Series {
			points := map[int64]float64{}
			for _, p := range s.Points {
				points[int64(number(p[0]))] = number(p[1])
			}
			got[key(s.Labels)] = points
		}
		var names []string
		for name := range want {
			names = append(names, name)
		}
		for name := range got {
			if _, ok := want[name]; !ok {
				report("%s: the tool has %s, Prometheus does not", q.Expr, name)
			}
		}
		sort.Strings(names)
		for _, name := range names {
			mine, ok := got[name]
			if !ok {
				report("%s: Prometheus has %s, the tool does not", q.Expr, name)
				continue
			}
			for t, v := range want[name] {
				points++
				w, ok := mine[t]
				if !ok {
					report("%s %s at %d: Prometheus %v, the tool nothing", q.Expr, name, t, v)
				} else if !same(v, w) {
					report("%s %s at %d: Prometheus %v, the tool %v", q.Expr, name, t, v, w)
				}
			}
			for t, w := range mine {
				if _, ok := want[name][t]; !ok {
					report("%s %s at %d: the tool %v, Prometheus nothing", q.Expr, name, t, w)
				}
			}
		}
		qry.Close()
	}
	fmt.Printf("%d queries, %d points compared with Prometheus's engine: %d differ\n", len(in.Queries), points, mismatches)
	if mismatches > 0 {
		os.Exit(1)
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "promql-check: "+format+"\n", args...)
	os.Exit(2)
}
