from megalite.optim.loss_scaler import LossScaler


def test_backoff_after_hysteresis_and_floor():
    s = LossScaler(initial=8.0, window=3, min_scale=2.0, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0  # the first overflow uses up hysteresis
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0  # never below min_scale


def test_growth_after_window_good_steps_restores_hysteresis():
    s = LossScaler(initial=4.0, window=3, hysteresis=2)
    s.update(True)
    for _ in range(2):
        s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0 and s.hysteresis_left == 2
    s.update(False)
    s.update(True)  # an overflow resets the good-step count
    s.update(False)
    s.update(False)
    assert s.scale == 8.0


def test_state_round_trip():
    s = LossScaler(initial=16.0, window=5)
    s.update(True)
    s.update(False)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.good_steps, t.hysteresis_left) == (16.0, 1, 1)
